// Package rediscache shares onceproxy's cache and flights across a fleet
// of processes through Redis (a single server, Sentinel or Cluster).
//
// One Store is both the dedup.Store (a small in-process tier in front of
// Redis values) and the dedup.Fleet (fleet-wide flights). A flight's lock,
// value and outcome share one hash tag, so every script touches one Cluster
// slot. Completion messages travel on one channel that each process
// subscribes to once; waiters also poll, so a lost message costs latency,
// never a duplicate fetch or a stuck client.
//
// Redis trouble never fails a request: commands have short timeouts and no
// retries, and a circuit breaker skips Redis for breaker_interval after
// breaker_failures consecutive failures. Meanwhile the engine runs on the
// memory tier and local flights (X-Cache: BYPASS for what goes upstream) and
// a probe after the interval brings the shared layer back by itself.
package rediscache

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
	"github.com/sony/gobreaker/v2"
	"golang.org/x/sync/singleflight"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// Store is the fleet-shared store and flight coordinator.
type Store struct {
	cfg   Config
	rdb   redis.UniversalClient
	local *dedup.MemoryStore
	log   *slog.Logger
	cb    *gobreaker.CircuitBreaker[any]

	instance string        // random id of this process, prefixes lease tokens
	seq      atomic.Uint64 // lease token counter
	prefix   string        // cfg.KeyPrefix + "v1:"
	channel  string        // the one events channel

	waiters waiterSet
	stats   statsBuf
	notes   notes
	// fleetWaits counts Joins waiting on another process's flight.
	fleetWaits atomic.Int64
	// gets shares one Redis GET among concurrent lookups of a key: a
	// stampede of N clients on one instance costs one round trip, not N
	// connections out of the pool (whose exhaustion would read as Redis
	// being slow and open the breaker exactly when sharing matters most).
	gets singleflight.Group

	// life is canceled by Close: lease renewals and waits stop with it.
	life   context.Context
	cancel context.CancelFunc
	leases sync.WaitGroup
	bg     sync.WaitGroup // OnReconnect functions running
}

var (
	_ dedup.Store    = (*Store)(nil)
	_ dedup.Fleet    = (*Store)(nil)
	_ dedup.Recorder = (*Store)(nil)
)

// New connects to the configured Redis. It does not fail when Redis is
// down at start: the breaker opens, the proxy runs alone, and the shared
// layer comes back when Redis does. local is the in-process tier (and the
// fallback while Redis is away).
func New(cfg Config, local *dedup.MemoryStore, logger *slog.Logger) (*Store, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("rediscache: %w", err)
	}
	if !cfg.Enabled() {
		return nil, errors.New("rediscache: no redis.url or redis.addrs configured")
	}
	opts, err := clientOptions(cfg)
	if err != nil {
		return nil, fmt.Errorf("rediscache: %w", err)
	}
	s := &Store{
		cfg:      cfg,
		rdb:      redis.NewUniversalClient(opts),
		local:    local,
		log:      logger,
		instance: randomHex(6),
		prefix:   cfg.KeyPrefix + "v1:",
	}
	s.channel = s.prefix + "events"
	s.life, s.cancel = context.WithCancel(context.Background())
	s.cb = gobreaker.NewCircuitBreaker[any](gobreaker.Settings{
		Name:        "redis",
		MaxRequests: 1, // one probe when the interval is over
		Timeout:     cfg.BreakerInterval,
		ReadyToTrip: func(c gobreaker.Counts) bool { return c.ConsecutiveFailures >= uint32(cfg.BreakerFailures) },
		IsSuccessful: func(err error) bool {
			return err == nil || errors.Is(err, redis.Nil)
		},
		// A caller that gave up says nothing about Redis.
		IsExcluded: func(err error) bool { return errors.Is(err, context.Canceled) },
		OnStateChange: func(_ string, from, to gobreaker.State) {
			switch to {
			case gobreaker.StateOpen:
				s.log.Warn("redis unavailable: deduplicating per instance (memory store, local flights) until it is back",
					"retry_in", cfg.BreakerInterval)
			case gobreaker.StateClosed:
				s.log.Info("redis is back: sharing cache and flights with the fleet again")
				if from != gobreaker.StateClosed {
					s.reconnected()
				}
			}
		},
	})
	s.waiters.m = make(map[string]map[chan struct{}]struct{})
	s.notes.handlers = make(map[string]func(string))
	s.notes.out = make(chan note, noteQueue)

	ctx, cancel := context.WithTimeout(context.Background(), cfg.DialTimeout+cfg.Timeout)
	defer cancel()
	if err := s.exec(ctx, func(ctx context.Context) error { return s.rdb.Ping(ctx).Err() }); err != nil {
		s.log.Warn("redis not reachable at start; running alone until it is", "redis", describe(cfg), "err", err)
	} else {
		s.log.Info("redis connected: cache and flights shared with the fleet", "redis", describe(cfg))
	}
	return s, nil
}

func clientOptions(cfg Config) (*redis.UniversalOptions, error) {
	o := &redis.UniversalOptions{
		Addrs:      cfg.Addrs,
		MasterName: cfg.MasterName,
		Username:   cfg.Username,
		Password:   cfg.Password,
		// Fail fast, never retry on the hot path: a client request must
		// not wait for Redis to come back. The breaker handles the rest.
		DialTimeout:           cfg.DialTimeout,
		DialerRetries:         1,
		ReadTimeout:           cfg.Timeout,
		WriteTimeout:          cfg.Timeout,
		PoolTimeout:           cfg.Timeout + cfg.DialTimeout,
		MaxRetries:            -1,
		ContextTimeoutEnabled: true,
		PoolSize:              cfg.PoolSize,
		ClientName:            "onceproxy",
		// Maintenance push notifications need Redis 8; off, not probed.
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled},
	}
	if cfg.URL != "" {
		u, err := redis.ParseURL(cfg.URL)
		if err != nil {
			return nil, fmt.Errorf("url: %w", err)
		}
		o.Addrs = []string{u.Addr}
		o.DB = u.DB
		o.Username, o.Password = u.Username, u.Password
		o.TLSConfig = u.TLSConfig
	}
	return o, nil
}

// describe names the Redis deployment for logs, without credentials.
func describe(cfg Config) string {
	if cfg.URL != "" {
		if u, err := redis.ParseURL(cfg.URL); err == nil {
			return u.Addr
		}
	}
	if cfg.MasterName != "" {
		return "sentinel " + cfg.MasterName + " via " + strings.Join(cfg.Addrs, ",")
	}
	return "cluster " + strings.Join(cfg.Addrs, ",")
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Client returns the Redis client (shared with the rate limiter).
func (s *Store) Client() redis.UniversalClient { return s.rdb }

// Available reports whether the shared layer is in use (breaker not open).
func (s *Store) Available() bool { return s.cb.State() != gobreaker.StateOpen }

// Close stops renewals and waits, and closes the connections. Call it
// after Run returned.
func (s *Store) Close() error {
	s.cancel()
	s.leases.Wait()
	s.bg.Wait()
	return s.rdb.Close()
}

// exec runs one Redis operation through the breaker with the command
// timeout. It returns nil, redis.Nil, the caller's context error, or an
// error wrapping dedup.ErrUnavailable.
func (s *Store) exec(ctx context.Context, op func(context.Context) error) error {
	_, err := s.cb.Execute(func() (any, error) {
		ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
		defer cancel()
		return nil, op(ctx)
	})
	switch {
	case err == nil, errors.Is(err, redis.Nil):
		return err
	case errors.Is(err, context.Canceled) && ctx.Err() != nil:
		return ctx.Err()
	case errors.Is(err, gobreaker.ErrOpenState), errors.Is(err, gobreaker.ErrTooManyRequests):
		return dedup.ErrUnavailable
	default:
		return fmt.Errorf("%w: %v", dedup.ErrUnavailable, err)
	}
}

// Key names. A dedup key is "v1:<64 hex>"; the hex is the hash tag, so
// the value, lock and outcome of one key live in one Cluster slot.
func tagOf(key string) string {
	if _, h, ok := strings.Cut(key, ":"); ok && h != "" {
		return h
	}
	return key
}

func (s *Store) valueKey(tag string) string   { return s.prefix + "{" + tag + "}:v" }
func (s *Store) lockKey(tag string) string    { return s.prefix + "{" + tag + "}:l" }
func (s *Store) outcomeKey(tag string) string { return s.prefix + "{" + tag + "}:o" }
func (s *Store) urlKey(urlKey string) string  { return s.prefix + "u:{" + tagOf(urlKey) + "}" }

// Get implements dedup.Store: the local tier, then Redis. While Redis is
// unavailable it answers from the local tier alone.
func (s *Store) Get(ctx context.Context, key string) (*dedup.Entry, error) {
	if e, err := s.local.Get(ctx, key); err == nil {
		return e, nil
	}
	// The shared GET must not end with whichever caller started it.
	ch := s.gets.DoChan(key, func() (any, error) {
		return s.getRemote(context.WithoutCancel(ctx), key)
	})
	select {
	case r := <-ch:
		if r.Err != nil {
			return nil, r.Err
		}
		return r.Val.(*dedup.Entry), nil
	case <-ctx.Done():
		return nil, dedup.ErrNotFound
	}
}

// getRemote reads key's value from Redis into the local tier.
func (s *Store) getRemote(ctx context.Context, key string) (*dedup.Entry, error) {
	var blob []byte
	err := s.exec(ctx, func(ctx context.Context) error {
		var err error
		blob, err = s.rdb.Get(ctx, s.valueKey(tagOf(key))).Bytes()
		return err
	})
	if err != nil {
		// Absent, or Redis away: both are a miss here; the breaker logs
		// the outage once instead of every request.
		return nil, dedup.ErrNotFound
	}
	e, err := decode(blob)
	if err != nil || !time.Now().Before(e.ExpiresAt) {
		return nil, dedup.ErrNotFound
	}
	s.putLocal(key, e)
	return e, nil
}

// putLocal keeps e in the local tier for at most LocalTTL and never past
// its Redis expiry: an invalidation whose message was lost is bounded by
// LocalTTL.
func (s *Store) putLocal(key string, e *dedup.Entry) {
	c := *e
	if limit := time.Now().Add(s.cfg.LocalTTL); c.ExpiresAt.After(limit) {
		c.ExpiresAt = limit
	}
	if ttl := time.Until(c.ExpiresAt); ttl > 0 {
		_ = s.local.Set(context.Background(), key, &c, ttl)
	}
}

// Set implements dedup.Store (used when a flight had no fleet lease):
// the local tier always, Redis when available. A value over
// max_value_bytes stays local.
func (s *Store) Set(ctx context.Context, key string, e *dedup.Entry, ttl time.Duration) error {
	if ttl <= 0 {
		return nil
	}
	e = e.Expiring(ttl)
	s.putLocal(key, e)
	blob := encode(e)
	if int64(len(blob)) > int64(s.cfg.MaxValueBytes) {
		return nil
	}
	err := s.exec(ctx, func(ctx context.Context) error {
		_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Set(ctx, s.valueKey(tagOf(key)), blob, ttl)
			s.index(ctx, p, e.URLKey, key, ttl)
			return nil
		})
		return err
	})
	if errors.Is(err, dedup.ErrUnavailable) {
		return nil // degraded: kept locally, the breaker already said so
	}
	return err
}

// index records key under its URL so invalidation by URL finds every
// variant. The set lives in the URL's own slot (not the key's): it is
// written next to the value, not in the same script.
func (s *Store) index(ctx context.Context, p redis.Pipeliner, urlKey, key string, ttl time.Duration) {
	if urlKey == "" {
		return
	}
	ik := s.urlKey(urlKey)
	p.SAdd(ctx, ik, tagOf(key))
	// The set outlives each member's value a little; stale members only
	// cost a DEL of a missing key at invalidation time.
	p.PExpire(ctx, ik, ttl+time.Minute)
}

// Delete implements dedup.Store, fleet-wide: the value in Redis, and every
// process's local tier through an event.
func (s *Store) Delete(ctx context.Context, key string) error {
	_ = s.local.Delete(ctx, key)
	tag := tagOf(key)
	return s.exec(ctx, func(ctx context.Context) error {
		_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Del(ctx, s.valueKey(tag))
			p.Publish(ctx, s.channel, "i "+tag)
			return nil
		})
		return err
	})
}

// DeleteURL implements dedup.Store, fleet-wide.
func (s *Store) DeleteURL(ctx context.Context, urlKey string) (int, error) {
	localN, _ := s.local.DeleteURL(ctx, urlKey)
	n := 0
	err := s.exec(ctx, func(ctx context.Context) error {
		tags, err := s.rdb.SMembers(ctx, s.urlKey(urlKey)).Result()
		if err != nil {
			return err
		}
		cmds := make([]*redis.IntCmd, len(tags))
		_, err = s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, tag := range tags {
				cmds[i] = p.Del(ctx, s.valueKey(tag))
			}
			p.Del(ctx, s.urlKey(urlKey))
			p.Publish(ctx, s.channel, "u "+urlKey)
			return nil
		})
		for _, c := range cmds {
			n += int(c.Val())
		}
		return err
	})
	if err != nil {
		return localN, err
	}
	return max(n, localN), nil
}

// Stats implements dedup.Store: the local tier's size (Redis memory is the
// operator's Redis to watch).
func (s *Store) Stats() dedup.StoreStats {
	st := s.local.Stats()
	st.Kind = "redis+memory"
	return st
}

// windowScript is a fixed-window counter: the first hit of a window sets
// its expiry.
var windowScript = redis.NewScript(`
local n = redis.call('INCR', KEYS[1])
if n == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return n
`)

// IncrWindow counts one hit on key for the fleet-wide rate limiter and
// returns the new count; the key expires after ttl. It fails fast with
// dedup.ErrUnavailable while the breaker is open.
func (s *Store) IncrWindow(ctx context.Context, key string, ttl time.Duration) (int64, error) {
	var n int64
	err := s.exec(ctx, func(ctx context.Context) error {
		var err error
		n, err = windowScript.Run(ctx, s.rdb, []string{s.prefix + key}, ttl.Milliseconds()).Int64()
		return err
	})
	return n, err
}
