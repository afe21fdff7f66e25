// Package pgstore shares onceproxy's cache, flights and fleet news across
// the instances of a fleet through PostgreSQL.
//
// A Backend is one database schema, seen as the two parts its consumers
// use:
//   - Cache: the shared cache and flights, what package dedup declares
//     (dedup.Store, dedup.Fleet). An unlogged table holds the values, in
//     the versioned format of package storecodec, with a small in-process
//     tier in front. A flight's leader is the instance that takes the
//     key's advisory lock, on one of its lock sessions, which hold the
//     locks of any number of flights (see lockSession): PostgreSQL drops
//     the locks by itself when the session ends, so a dead leader is
//     replaced without leases to renew.
//   - Bus: notes, claims and counters, what the upstream pool, the rate
//     limiter and the statistics declare (upstream.Bus and Claimer,
//     ratelimit.Counter, dedup.Recorder, the fleet's per-day statistics).
//
// Flight completions, invalidations and notes travel on one NOTIFY channel
// that each process LISTENs to on one connection; waiters also poll, so a
// lost notification costs latency, never a duplicate fetch or a stuck
// client. Everything read back from the database is untrusted input
// (another version, a person with psql): it is checked, and what cannot be
// read is counted and ignored. The schema is created on first start and
// carries a version; a schema of another version is refused.
//
// Database trouble never fails a request: statements have short timeouts
// (statement_timeout) and no retries, and a circuit breaker skips the
// database for breaker_interval after breaker_failures consecutive
// failures. Meanwhile the engine runs on the memory store (whole TTLs) and
// local flights (X-Cache: BYPASS for what goes upstream), a probe brings
// the shared layer back by itself, and what was cached meanwhile is shared
// then, never over a newer value.
package pgstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"golang.org/x/sync/errgroup"

	"github.com/seed-a3c387e8/onceproxy/internal/workers"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// Backend is one PostgreSQL schema shared by the fleet. Open it, run its
// background loops with Run, release it with Close.
type Backend struct {
	// Cache is the shared cache and flights.
	Cache *Cache
	// Bus carries notes, claims and counters between the instances.
	Bus   *Bus
	c     *client
	sweep *sweeper
}

// Open connects to the configured database and checks (or creates) the
// schema. It does not fail when the database is down at start: the proxy
// runs alone, and the shared layer comes up when the database does. It
// fails on a schema of another version. local is the in-process tier of
// the cache (and the cache itself while the database is away).
func Open(cfg Config, local *dedup.MemoryStore, logger *slog.Logger) (*Backend, error) {
	return open(cfg, local, logger, nil)
}

// open is Open with a tracer on the pooled and flight connections (tests
// count statements with it).
func open(cfg Config, local *dedup.MemoryStore, logger *slog.Logger, tracer pgx.QueryTracer) (*Backend, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("pgstore: %w", err)
	}
	if !cfg.Enabled() {
		return nil, errors.New("pgstore: no postgres.url configured")
	}
	c, err := newClient(cfg, logger, tracer)
	if err != nil {
		return nil, fmt.Errorf("pgstore: %w", err)
	}
	b := &Backend{c: c, Cache: newCache(c, local), Bus: newBus(c), sweep: &sweeper{c: c}}
	if err := c.start(); err != nil {
		b.Close()
		return nil, err
	}
	return b, nil
}

// Run keeps the fleet connection alive until ctx ends: the listener, the
// notes' sender, the periodic flush of statistics, the sweep, the probe
// that keeps the breaker true to the database, and the sharing of what was
// cached during an outage.
func (b *Backend) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { b.listen(ctx); return nil })
	g.Go(func() error { b.Bus.flushStats(ctx); return nil })
	g.Go(func() error { b.Bus.sendNotes(ctx); return nil })
	g.Go(func() error { b.sweep.run(ctx); return nil })
	g.Go(func() error { b.c.probe(ctx); return nil })
	g.Go(func() error { b.Cache.share(ctx); return nil })
	g.Go(func() error { b.Cache.pollWaits(ctx); return nil })
	return g.Wait()
}

// Available reports whether the shared layer is in use: the schema is
// checked and the breaker is not open.
func (b *Backend) Available() bool { return b.c.available() }

// Rejected counts what this instance read from the database and ignored
// because it could not use it: values, outcomes, notifications and
// recalled notes.
func (b *Backend) Rejected() int64 { return b.c.rejected.Load() }

// Errors counts the statements that failed (timeouts, refused
// connections, errors from the server); statements skipped while the
// breaker is open are not counted.
func (b *Backend) Errors() int64 { return b.c.failed.Load() }

// UnlockedFlights counts the flights this instance led without the fleet
// lock, with flight_locks of them leading already or the server's lock
// table full: another instance may have fetched the same key meanwhile.
func (b *Backend) UnlockedFlights() int64 { return b.Cache.unlocked.Load() }

// closeWait bounds how long Close waits for flights still holding a lock
// (the engine ends them before).
const closeWait = 5 * time.Second

// Close stops the background work and closes the connections. Call it
// after Run returned.
func (b *Backend) Close() error {
	// Under mu: what starts background work (reconnected, background)
	// checks life and adds to bg under it, so none is added once Wait
	// may have begun.
	b.c.mu.Lock()
	b.c.cancel()
	b.c.mu.Unlock()
	b.c.bg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), closeWait)
	defer cancel()
	if workers.Wait(ctx, &b.c.leases) != nil {
		b.c.log.Warn("postgres: flights still running at shutdown; their locks go with their sessions")
	}
	// pgxpool.Close waits for every connection out of the pool: only
	// once every session's is back (ended).
	if b.c.closeSessions(closeWait) {
		b.c.flights.Close()
	}
	b.c.pool.Close()
	return nil
}
