package rediscache

import (
	"errors"
	"fmt"
	"math"
	"net"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/redact"
)

// Config is the `redis:` section of config.yaml. With neither URL nor
// Addrs set, onceproxy runs alone on its memory store.
type Config struct {
	// URL of a single Redis server: redis://[user:pass@]host:6379/0 or
	// rediss:// for TLS. The conventional REDIS_URL variable fills it.
	URL string `yaml:"url"`
	// Addrs are Cluster seed nodes, or Sentinel addresses with MasterName.
	Addrs []string `yaml:"addrs"`
	// MasterName selects Sentinel: the name of the monitored master.
	MasterName string `yaml:"master_name"`
	// Username and Password authenticate with Addrs (URL carries its own).
	Username string `yaml:"username"`
	Password string `yaml:"password"`
	// KeyPrefix starts every key and channel name. Default "onceproxy:".
	KeyPrefix string `yaml:"key_prefix"`
	// DialTimeout bounds connecting to Redis. Default 200ms: a proxy must
	// not stall its clients on a Redis that is gone.
	DialTimeout time.Duration `yaml:"dial_timeout"`
	// Timeout bounds each command. Default 250ms.
	Timeout time.Duration `yaml:"timeout"`
	// PoolSize is the connection pool size; 0 = go-redis default (10 per CPU).
	PoolSize int `yaml:"pool_size"`
	// BreakerFailures consecutive failed commands open the circuit breaker.
	// Default 3.
	BreakerFailures int `yaml:"breaker_failures"`
	// BreakerInterval is how long Redis is skipped once the breaker opens
	// (memory store and local flights only) before one probe. Default 5s.
	BreakerInterval time.Duration `yaml:"breaker_interval"`
	// Lease is the lifetime of a flight's lock; the leader renews it every
	// third of it. A leader whose instance is known to be gone
	// (PresenceTTL) is replaced sooner; Lease is the bound for the rest
	// (an instance of an older version). Default 5s.
	Lease time.Duration `yaml:"lease"`
	// PresenceTTL is how long an instance that stopped answering (crashed,
	// cut off from Redis) still holds its flights: each instance refreshes
	// a presence key every third of it, and waiters elsewhere take over a
	// flight whose leader's key has lapsed. At least 3 × Timeout; 0 means
	// 1.5s, or 3 × Timeout when that is longer.
	PresenceTTL time.Duration `yaml:"presence_ttl"`
	// PollInterval is how often the instance re-checks, in one pipeline,
	// every flight it waits on: the safety net when a completion message
	// is lost or a leader died. Default 100ms.
	PollInterval time.Duration `yaml:"poll_interval"`
	// FailureTTL keeps a failed or uncacheable flight's outcome for waiters
	// that poll. Default 5s.
	FailureTTL time.Duration `yaml:"failure_ttl"`
	// MaxValueBytes caps a value cached in Redis (after compression): a
	// bigger response is cached in this process only, for its full TTL,
	// and reaches the waiters on other instances once, as its flight's
	// short-lived outcome. Default 2MiB.
	MaxValueBytes bytesize.Size `yaml:"max_value_bytes"`
	// LocalTTL is how long this process answers from its memory copy of a
	// shared value before asking Redis again (never past the value's TTL):
	// it bounds how long an invalidation whose message was lost can go
	// unnoticed. While Redis is unavailable the memory tier answers for
	// the full TTL. Default 2s.
	LocalTTL time.Duration `yaml:"local_ttl"`
	// StatsFlush is how often this instance adds its counters to the
	// fleet-wide per-day statistics. Default 1s.
	StatsFlush time.Duration `yaml:"stats_flush"`
}

// Enabled reports whether a Redis server is configured.
func (c Config) Enabled() bool { return c.URL != "" || len(c.Addrs) > 0 }

// WithDefaults returns c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.KeyPrefix == "" {
		c.KeyPrefix = "onceproxy:"
	}
	set := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	set(&c.DialTimeout, 200*time.Millisecond)
	set(&c.Timeout, 250*time.Millisecond)
	set(&c.BreakerInterval, 5*time.Second)
	set(&c.Lease, 5*time.Second)
	set(&c.PollInterval, 100*time.Millisecond)
	set(&c.FailureTTL, 5*time.Second)
	set(&c.LocalTTL, 2*time.Second)
	set(&c.StatsFlush, time.Second)
	set(&c.PresenceTTL, max(1500*time.Millisecond, thrice(c.Timeout)))
	if c.BreakerFailures == 0 {
		c.BreakerFailures = 3
	}
	if c.MaxValueBytes == 0 {
		c.MaxValueBytes = 2 * bytesize.MiB
	}
	return c
}

// Validate reports every problem in c, each prefixed with its yaml key.
func (c Config) Validate() error {
	var errs []error
	if c.URL != "" && len(c.Addrs) > 0 {
		errs = append(errs, errors.New("url: set either url or addrs, not both"))
	}
	if c.URL != "" {
		if _, err := redis.ParseURL(c.URL); err != nil {
			errs = append(errs, fmt.Errorf("url: %s: %w", redact.AsWritten(c.URL), redact.Error(err, c.URL)))
		}
	}
	for i, a := range c.Addrs {
		if _, _, err := net.SplitHostPort(a); err != nil {
			errs = append(errs, fmt.Errorf("addrs[%d]: %q is not host:port", i, a))
		}
	}
	if strings.ContainsAny(c.KeyPrefix, "{}") {
		// Redis Cluster hashes a key by its first {...}: the prefix would
		// pick the slot of every key, one slot for the whole fleet (a
		// single shard doing all the work), or, unmatched, slots that
		// part keys a script needs together. Refused on a single server
		// too: the same configuration moves to a Cluster.
		errs = append(errs, fmt.Errorf("key_prefix: must not contain { or }: Redis Cluster would take it for a hash tag and put every key in one slot, got %q", c.KeyPrefix))
	}
	if c.MasterName != "" && len(c.Addrs) == 0 {
		errs = append(errs, errors.New("master_name: needs the Sentinel addresses in addrs"))
	}
	for _, d := range []struct {
		key string
		v   time.Duration
	}{
		{"dial_timeout", c.DialTimeout}, {"timeout", c.Timeout}, {"breaker_interval", c.BreakerInterval},
		{"lease", c.Lease}, {"presence_ttl", c.PresenceTTL}, {"poll_interval", c.PollInterval}, {"failure_ttl", c.FailureTTL},
		{"local_ttl", c.LocalTTL}, {"stats_flush", c.StatsFlush},
	} {
		if d.v <= 0 {
			errs = append(errs, fmt.Errorf("%s: must be positive, got %s", d.key, d.v))
		}
	}
	for _, d := range []struct {
		key string
		v   time.Duration
	}{{"dial_timeout", c.DialTimeout}, {"timeout", c.Timeout}} {
		if d.v > maxTimeout {
			errs = append(errs, fmt.Errorf("%s: must be at most %s (a command's deadline and the pool's wait add dial_timeout and timeout), got %s", d.key, maxTimeout, d.v))
		}
	}
	if c.Lease > 0 && c.Lease < thrice(c.Timeout) {
		errs = append(errs, fmt.Errorf("lease: must be at least 3 × timeout (%s) so renewals land in time, got %s", thrice(c.Timeout), c.Lease))
	}
	if c.PresenceTTL > 0 && c.PresenceTTL < thrice(c.Timeout) {
		errs = append(errs, fmt.Errorf("presence_ttl: must be at least 3 × timeout (%s) so a refresh lands in time, got %s", thrice(c.Timeout), c.PresenceTTL))
	}
	if c.BreakerFailures < 1 {
		errs = append(errs, fmt.Errorf("breaker_failures: must be at least 1, got %d", c.BreakerFailures))
	} else if c.BreakerFailures > math.MaxUint32 {
		// The breaker counts consecutive failures in a uint32.
		errs = append(errs, fmt.Errorf("breaker_failures: must be at most %d, got %d", uint32(math.MaxUint32), c.BreakerFailures))
	}
	if c.PoolSize < 0 {
		errs = append(errs, fmt.Errorf("pool_size: must not be negative, got %d", c.PoolSize))
	}
	if c.MaxValueBytes < 1024 {
		errs = append(errs, fmt.Errorf("max_value_bytes: must be at least 1KiB, got %s", c.MaxValueBytes))
	}
	return errors.Join(errs...)
}

// maxTimeout bounds dial_timeout and timeout. A command's deadline and the
// pool's wait for a connection are their sum (client.go): near
// time.Duration's end (2562047h) it wrapped round below zero, and every
// command failed before it was sent. A day is past any real Redis wait.
const maxTimeout = 24 * time.Hour

// thrice is 3 × d, held at the longest duration rather than wrapping
// round: a lease or presence_ttl shorter than a huge timeout must not pass
// for a product that overflowed.
func thrice(d time.Duration) time.Duration {
	if d > math.MaxInt64/3 {
		return math.MaxInt64
	}
	return 3 * d
}
