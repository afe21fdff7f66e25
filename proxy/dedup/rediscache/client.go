package rediscache

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
	"github.com/sony/gobreaker/v2"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// client is what the Cache and the Bus share: the connections, the
// breaker, the names, and this process's identity in the fleet.
type client struct {
	cfg Config
	rdb redis.UniversalClient
	cb  *gobreaker.CircuitBreaker[any]
	log *slog.Logger

	instance string        // random id of this process: prefixes tokens, marks its own notes
	seq      atomic.Uint64 // token counter
	prefix   string        // cfg.KeyPrefix + "v1:"
	channel  string        // the one events channel

	// rejected counts input from Redis that was ignored (Backend.Rejected).
	rejected atomic.Int64
	// failed counts commands that failed: timeouts, refused connections,
	// errors from Redis (Backend.Errors).
	failed atomic.Int64

	// presentUntil is when this process's presence key lapses, as far as
	// the last successful heartbeat knows (unix ns; 0: not confirmed).
	presentUntil atomic.Int64
	// lostAt is when Redis was last seen to have lost its data (unix ns;
	// 0: never, as far as this process knows).
	lostAt atomic.Int64

	mu     sync.Mutex
	onBack []func() // run each time Redis comes back after an outage
	epoch  string   // the fleet's epoch as last read (heartbeat.go)
	// kick asks the heartbeat for a beat now: the breaker is half-open
	// and waits for its probe.
	kick chan struct{}

	// life is canceled by Close: the heartbeat, lease renewals, waits and
	// reconnect work stop with it.
	life   context.Context
	cancel context.CancelFunc
	bg     sync.WaitGroup // the heartbeat, the batcher and onBack functions running

	// batch sends the flights' steps of concurrent requests together.
	batch *batcher
}

func newClient(cfg Config, logger *slog.Logger) (*client, error) {
	opts, err := clientOptions(cfg)
	if err != nil {
		return nil, err
	}
	c := &client{
		cfg:      cfg,
		rdb:      redis.NewUniversalClient(opts),
		log:      logger,
		instance: randomHex(6),
		prefix:   cfg.KeyPrefix + "v1:",
	}
	c.channel = c.prefix + "events"
	c.kick = make(chan struct{}, 1)
	c.life, c.cancel = context.WithCancel(context.Background())
	c.batch = newBatcher(c.life, &c.bg, c.rdb, cfg.Timeout)
	c.cb = gobreaker.NewCircuitBreaker[any](gobreaker.Settings{
		Name:        "redis",
		MaxRequests: 1, // one probe when the interval is over
		Timeout:     cfg.BreakerInterval,
		ReadyToTrip: func(n gobreaker.Counts) bool { return n.ConsecutiveFailures >= uint32(cfg.BreakerFailures) },
		// A key of the wrong type is bad data that Redis answered
		// about: it says nothing against Redis (see errWrongType).
		IsSuccessful: func(err error) bool {
			return err == nil || errors.Is(err, redis.Nil) || isWrongType(err)
		},
		// A caller that gave up says nothing about Redis.
		IsExcluded: func(err error) bool { return errors.Is(err, context.Canceled) },
		OnStateChange: func(_ string, from, to gobreaker.State) {
			switch to {
			case gobreaker.StateOpen:
				if from == gobreaker.StateClosed {
					c.log.Warn("redis unavailable: deduplicating per instance (memory store, local flights) until it is back",
						"retry_in", cfg.BreakerInterval)
				}
			case gobreaker.StateHalfOpen:
				// The heartbeat is the probe: beat now.
				select {
				case c.kick <- struct{}{}:
				default:
				}
			case gobreaker.StateClosed:
				c.log.Info("redis is back: sharing cache and flights with the fleet again")
				if from != gobreaker.StateClosed {
					c.reconnected()
				}
			}
		},
	})
	return c, nil
}

// start checks Redis once, for the log (a Redis that is down is not an
// error: the breaker takes it from here), and starts the heartbeat.
func (c *client) start() {
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.DialTimeout+c.cfg.Timeout)
	defer cancel()
	if err := c.beat(ctx); err != nil {
		c.log.Warn("redis not reachable at start; running alone until it is", "redis", describe(c.cfg), "err", err)
	} else {
		c.log.Info("redis connected: cache and flights shared with the fleet", "redis", describe(c.cfg))
	}
	c.bg.Add(1)
	go c.heartbeat()
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
		// RESP2: nothing here reads a RESP3-only reply, and with RESP3
		// go-redis checks every pipeline for push notifications before
		// and after it, 2% of an instance's CPU on unique misses
		// (BenchmarkStores/redis/miss). Sentinel and Cluster speak it
		// too, as do the proxies in front of Redis that predate RESP3.
		Protocol: 2,
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

// available reports whether the shared layer is in use: the breaker is
// closed. While it is half-open only the heartbeat goes to Redis, as the
// probe: the probe reads the fleet's epoch before any request can learn
// that Redis is back, so copies Redis lost meanwhile are known as such.
func (c *client) available() bool { return c.cb.State() == gobreaker.StateClosed }

// exec runs one Redis operation through the breaker with the command
// timeout. It returns nil, redis.Nil, the caller's context error, or an
// error wrapping dedup.ErrUnavailable (at once while the breaker is not
// closed).
func (c *client) exec(ctx context.Context, op func(context.Context) error) error {
	if !c.available() {
		return dedup.ErrUnavailable
	}
	return c.run(ctx, op, true)
}

// execBatched is exec for an op whose commands all go through the
// batcher, which bounds their time itself (see batcher.do): a request's
// steps then cost no timer and context of their own, twice per miss.
func (c *client) execBatched(ctx context.Context, op func(context.Context) error) error {
	if !c.available() {
		return dedup.ErrUnavailable
	}
	return c.run(ctx, op, false)
}

// probe is exec that also runs while the breaker is half-open, as the one
// request that decides whether Redis is back. Only the heartbeat probes.
func (c *client) probe(ctx context.Context, op func(context.Context) error) error {
	return c.run(ctx, op, true)
}

// run runs op through the breaker, within Timeout when bounded.
func (c *client) run(ctx context.Context, op func(context.Context) error, bounded bool) error {
	_, err := c.cb.Execute(func() (any, error) {
		if !bounded {
			return nil, op(ctx)
		}
		ctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
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
	case isWrongType(err):
		return fmt.Errorf("%w: %v", errWrongType, err)
	default:
		c.failed.Add(1)
		return fmt.Errorf("%w: %v", dedup.ErrUnavailable, err)
	}
}

// errWrongType answers an operation on a key that holds another type than
// the one this package writes there (another program's, or another
// version's): bad input, not an outage. The callers remove such a key
// (dropForeign) rather than let it fail every request for it.
var errWrongType = errors.New("rediscache: a key holds another type than this package writes")

func isWrongType(err error) bool { return err != nil && redis.HasErrorPrefix(err, "WRONGTYPE") }

// dropForeign removes those of keys that hold another type than a string,
// the only type this package keeps in them, and counts them as rejected
// input.
func (c *client) dropForeign(ctx context.Context, keys ...string) {
	types := make([]*redis.StatusCmd, len(keys))
	err := c.exec(ctx, func(ctx context.Context) error {
		_, err := c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, k := range keys {
				types[i] = p.Type(ctx, k)
			}
			return nil
		})
		return err
	})
	if err != nil {
		return
	}
	var foreign []string
	for i, t := range types {
		if typ := t.Val(); typ != "string" && typ != "none" {
			foreign = append(foreign, keys[i])
			c.log.Warn("redis: a key holds another type than onceproxy writes there; removing it", "key", keys[i], "type", typ)
		}
	}
	if len(foreign) == 0 {
		return
	}
	c.rejected.Add(int64(len(foreign)))
	_ = c.exec(ctx, func(ctx context.Context) error { return c.rdb.Del(ctx, foreign...).Err() })
}

// onReconnect registers f to run each time Redis comes back after the
// breaker opened.
func (c *client) onReconnect(f func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.onBack = append(c.onBack, f)
}

// reconnected runs the onReconnect functions. It is called from the
// breaker's state change, under the breaker's lock, where a Redis call
// would deadlock: hence goroutines, which Close waits for.
func (c *client) reconnected() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.life.Err() != nil {
		return
	}
	for _, f := range c.onBack {
		c.bg.Add(1)
		go func() {
			defer c.bg.Done()
			defer c.recoverInput("reconnect")
			f()
		}()
	}
}

// recoverInput keeps a panic while handling what came from Redis from
// taking the process down: it is logged and counted as rejected input.
// Deferred by every goroutine that handles fleet input.
func (c *client) recoverInput(where string) {
	if r := recover(); r != nil {
		c.rejected.Add(1)
		c.log.Error("panic while handling input from redis; ignored", "where", where,
			"panic", r, "stack", string(debug.Stack()))
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

func fullKey(tag string) string { return dedup.KeyPrefix + tag }

func (c *client) valueKey(tag string) string   { return c.prefix + "{" + tag + "}:v" }
func (c *client) lockKey(tag string) string    { return c.prefix + "{" + tag + "}:l" }
func (c *client) outcomeKey(tag string) string { return c.prefix + "{" + tag + "}:o" }
func (c *client) waitersKey(tag string) string { return c.prefix + "{" + tag + "}:w" }
func (c *client) urlKey(urlKey string) string  { return c.prefix + "u:{" + tagOf(urlKey) + "}" }

// indexBuckets is how many URL index sets a URL may have: its variants
// are indexed by TTL, in buckets of powers of two seconds (indexBucket).
const indexBuckets = 25

// indexSet is the URL index set of urlKey's variants in bucket b.
func (c *client) indexSet(urlKey string, b int) string {
	return c.urlKey(urlKey) + ":" + strconv.Itoa(b)
}

// indexBucket is the bucket of the URL index set for a variant kept for
// ttl, and the expiry that set takes: the bucket's bound, the next power
// of two seconds at or above ttl (the last bucket: ttl), and a minute more.
//
// A set per bucket rather than one per URL: every write sets its set's
// expiry, and with one set a variant kept for a second, stored after one
// kept for an hour, cut the set's life to a minute and a second, so that
// invalidation by URL no longer found the hour's variant. Within a bucket
// every write sets the same span, so a set outlives each of its members.
// Keyed by the URL's tag, the sets share a Cluster slot with the URL's
// other keys: DeleteURL reads them all in one pipeline.
func indexBucket(ttl time.Duration) (b int, life time.Duration) {
	bound := time.Second
	for bound < ttl && b < indexBuckets-1 {
		b++
		bound *= 2
	}
	return b, max(bound, ttl) + time.Minute
}

// flightKeys are the KEYS of the flight scripts, in their order: lock,
// value, outcome, waiters (the names lockKey and the others give). They
// are cut from one string, built once per flight: one allocation, not
// four.
func (c *client) flightKeys(tag string) []string {
	n := len(c.prefix) + len(tag) + 4 // prefix, "{", tag, "}:", the letter
	var b strings.Builder
	b.Grow(4 * n)
	for _, k := range "lvow" {
		b.WriteString(c.prefix)
		b.WriteByte('{')
		b.WriteString(tag)
		b.WriteString("}:")
		b.WriteRune(k)
	}
	all := b.String()
	return []string{all[:n], all[n : 2*n], all[2*n : 3*n], all[3*n:]}
}
