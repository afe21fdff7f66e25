// Package rediscache shares onceproxy's cache, flights and fleet news
// across the instances of a fleet through Redis (a single server, Sentinel
// or Cluster).
//
// A Backend is one Redis deployment, seen as the two parts its consumers
// use:
//   - Cache: the shared cache and flights, what package dedup declares
//     (dedup.TieredStore, dedup.Fleet). A tier in process memory sits in
//     front of the Redis values. A flight's lock, value, outcome and
//     waiters flag share one hash tag, so every script touches one Cluster
//     slot; a miss costs its leader two round trips (join, finish), a hit
//     or a waiter one before it has its answer or waits.
//   - Bus: notes, claims and counters, what the upstream pool, the rate
//     limiter and the statistics declare (upstream.Bus and Claimer,
//     ratelimit.Counter, dedup.Recorder, the fleet's per-day statistics).
//
// Completion messages, invalidations and notes travel on one channel that
// each process subscribes to once; waiters also poll, so a lost message
// costs latency, never a duplicate fetch or a stuck client. Everything read
// back from Redis is untrusted input (another version, a person with
// redis-cli): it is checked, and what cannot be read is ignored.
//
// Redis trouble never fails a request: commands have short timeouts and no
// retries, and a circuit breaker skips Redis for breaker_interval after
// breaker_failures consecutive failures. Meanwhile the engine runs on the
// memory tier, which is then the cache (full TTL), and local flights
// (X-Cache: BYPASS for what goes upstream); a probe after the interval
// brings the shared layer back by itself, and Redis gets back what was
// cached meanwhile. A heartbeat keeps each instance's presence in Redis, so
// that the flights of an instance that dies are taken over quickly, and
// keeps the breaker's view true on an idle instance.
package rediscache

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"golang.org/x/sync/errgroup"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// Backend is one Redis deployment shared by the fleet. Open it, run its
// background loops with Run, release it with Close.
type Backend struct {
	// Cache is the shared cache and flights.
	Cache *Cache
	// Bus carries notes, claims and counters between the instances.
	Bus *Bus
	c   *client
}

// Open connects to the configured Redis and starts the heartbeat (until
// Close). It does not fail when Redis is down at start: the breaker opens,
// the proxy runs alone, and the shared layer comes back when Redis does.
// local is the in-process tier of the cache (and the cache while Redis is
// away).
func Open(cfg Config, local *dedup.MemoryStore, logger *slog.Logger) (*Backend, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("rediscache: %w", err)
	}
	if !cfg.Enabled() {
		return nil, errors.New("rediscache: no redis.url or redis.addrs configured")
	}
	c, err := newClient(cfg, logger)
	if err != nil {
		return nil, fmt.Errorf("rediscache: %w", err)
	}
	b := &Backend{c: c, Cache: newCache(c, local), Bus: newBus(c)}
	c.start()
	return b, nil
}

// Run keeps the fleet connection alive until ctx ends: the one events
// subscription of this process (flight completions wake local waiters,
// invalidations clear the local tier, notes reach their subscribers), the
// notes' sender and the periodic flush of statistics. go-redis
// re-subscribes by itself after Redis comes back; while the subscription is
// down, waiters fall back on polling. The heartbeat is not Run's: it runs
// from Open to Close, so that flights still finishing during a graceful
// shutdown keep their leader present.
func (b *Backend) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { b.subscribe(ctx); return nil })
	g.Go(func() error { b.Bus.flushStats(ctx); return nil })
	g.Go(func() error { b.Bus.sendNotes(ctx); return nil })
	g.Go(func() error { b.Cache.pollWaits(ctx); return nil })
	return g.Wait()
}

// Available reports whether the shared layer is in use (breaker not open).
// The heartbeat keeps it true to Redis on an instance without traffic.
func (b *Backend) Available() bool { return b.c.available() }

// Rejected counts what this instance read from Redis and ignored because
// it could not use it: malformed events, notes and recalled notes.
func (b *Backend) Rejected() int64 { return b.c.rejected.Load() }

// Errors counts the Redis commands that failed (timeouts, refused
// connections, errors from Redis); commands skipped while the breaker is
// open are not counted.
func (b *Backend) Errors() int64 { return b.c.failed.Load() }

// UnlockedFlights is 0: every flight this instance leads in Redis holds
// its lock (without Redis, requests bypass the fleet instead).
func (b *Backend) UnlockedFlights() int64 { return 0 }

// Close stops the heartbeat (removing this instance's presence key),
// renewals, waits and reconnect work, and closes the connections. Call it
// after Run returned and the engine's flights ended.
func (b *Backend) Close() error {
	b.c.cancel()
	b.Cache.leases.Wait()
	b.c.bg.Wait()
	b.Cache.marks.StopAllGoroutines()
	return b.c.rdb.Close()
}
