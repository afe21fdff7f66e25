// Package ratelimit keeps one client from flooding the proxy: a fixed
// window of N requests per client, counted in this process or, when Redis
// is configured, across the fleet. Who the client is (its proxy account,
// else its IP) is the front door's decision (clientinfo.Info.Client); the
// limiter only counts. It also offers Polite, a per-target-host pace for
// upstream requests.
package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/maypok86/otter/v2"

	"github.com/seed-a3c387e8/onceproxy/internal/hostmatch"
)

// Config is the `rate_limit:` section of config.yaml.
type Config struct {
	// Requests allowed per client per window; 0 turns client limits off.
	Requests int `yaml:"requests"`
	// Window is the fixed window. Default 1m.
	Window time.Duration `yaml:"window"`
	// FailClosed refuses requests (503) when the shared counter (Redis) is
	// unreachable. Default false: fail open, let them through.
	FailClosed bool `yaml:"fail_closed"`
	// ExcludeHosts are target hosts whose requests are not counted: host
	// patterns ("status.example.com", "*.internal.example" for every
	// subdomain).
	ExcludeHosts []string `yaml:"exclude_hosts"`
	// PerHostRPS paces requests going upstream to one target host (all
	// clients together): politeness toward the sites you scrape. 0 = off.
	PerHostRPS float64 `yaml:"per_host_rps"`
	// PerHostBurst is the burst allowed above PerHostRPS. Default 1.
	PerHostBurst int `yaml:"per_host_burst"`
}

// WithDefaults returns c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.Window == 0 {
		c.Window = time.Minute
	}
	if c.PerHostBurst == 0 {
		c.PerHostBurst = 1
	}
	return c
}

// Validate reports every problem in c, each prefixed with its yaml key.
func (c Config) Validate() error {
	var errs []error
	if c.Requests < 0 {
		errs = append(errs, fmt.Errorf("requests: must not be negative, got %d", c.Requests))
	}
	if c.Window < time.Second {
		errs = append(errs, fmt.Errorf("window: must be at least 1s, got %s", c.Window))
	}
	for i, h := range c.ExcludeHosts {
		if err := hostmatch.Valid(h); err != nil {
			errs = append(errs, fmt.Errorf("exclude_hosts[%d]: %w", i, err))
		}
	}
	if c.PerHostRPS < 0 || math.IsNaN(c.PerHostRPS) || math.IsInf(c.PerHostRPS, 0) {
		errs = append(errs, fmt.Errorf("per_host_rps: must be a non-negative number, got %v", c.PerHostRPS))
	}
	if c.PerHostBurst < 1 {
		errs = append(errs, fmt.Errorf("per_host_burst: must be at least 1, got %d", c.PerHostBurst))
	}
	return errors.Join(errs...)
}

// Counter counts hits in a fixed window: it increments key and returns the
// new count, the key expiring after ttl. The memory counter is in this
// package; the fleet one is rediscache.Store.
type Counter interface {
	IncrWindow(ctx context.Context, key string, ttl time.Duration) (int64, error)
}

// Limiter decides per request. Create it with New.
type Limiter struct {
	set      atomic.Pointer[limits] // replaced whole by Reconfigure
	counter  Counter
	own      *MemoryCounter // the counter New made, closed by Close
	rejected atomic.Uint64
	failed   atomic.Uint64
	now      func() time.Time
}

// New returns a limiter counting in counter (nil: in this process).
func New(cfg Config, counter Counter) (*Limiter, error) {
	l := &Limiter{counter: counter, now: time.Now}
	if err := l.Reconfigure(cfg); err != nil {
		return nil, err
	}
	if counter == nil {
		l.own = NewMemoryCounter()
		l.counter = l.own
	}
	return l, nil
}

// limits is a compiled Config.
type limits struct {
	cfg     Config
	exclude *hostmatch.Set
}

func compile(cfg Config) (*limits, error) {
	exclude, err := hostmatch.Compile(cfg.ExcludeHosts)
	if err != nil {
		return nil, fmt.Errorf("rate_limit: exclude_hosts%w", err)
	}
	return &limits{cfg: cfg, exclude: exclude}, nil
}

// Reconfigure replaces the limits while the limiter serves (a reload of
// the configuration): requests already counted stay counted in their
// window. It fails, changing nothing, for an invalid cfg.
func (l *Limiter) Reconfigure(cfg Config) error {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("rate_limit: %w", err)
	}
	set, err := compile(cfg)
	if err != nil {
		return err
	}
	l.set.Store(set)
	return nil
}

// Close stops the background work of a counter New made itself.
func (l *Limiter) Close() {
	if l != nil && l.own != nil {
		l.own.Close()
	}
}

// Decision is the verdict on one request.
type Decision struct {
	Allowed    bool
	Limit      int
	Remaining  int
	RetryAfter time.Duration // until the window resets, when refused
	// Unavailable: the shared counter could not be reached (the request
	// was let through, unless FailClosed).
	Unavailable bool
}

// Enabled reports whether client limits are on.
func (l *Limiter) Enabled() bool { return l != nil && l.set.Load().cfg.Requests > 0 }

// Allow counts one request by client (clientinfo.Info.Client) to host.
func (l *Limiter) Allow(ctx context.Context, client, host string) Decision {
	if l == nil {
		return Decision{Allowed: true}
	}
	set := l.set.Load()
	if set.cfg.Requests <= 0 || set.exclude.Match(host) {
		return Decision{Allowed: true}
	}
	now := l.now()
	w := set.cfg.Window
	start := now.Truncate(w)
	key := "rl:" + client + ":" + strconv.FormatInt(start.Unix(), 10)
	n, err := l.counter.IncrWindow(ctx, key, w+time.Second)
	reset := start.Add(w).Sub(now)
	if err != nil {
		l.failed.Add(1)
		if set.cfg.FailClosed {
			return Decision{Allowed: false, Limit: set.cfg.Requests, RetryAfter: reset, Unavailable: true}
		}
		return Decision{Allowed: true, Limit: set.cfg.Requests, Unavailable: true}
	}
	d := Decision{Limit: set.cfg.Requests, Remaining: max(set.cfg.Requests-int(n), 0)}
	if n <= int64(set.cfg.Requests) {
		d.Allowed = true
		return d
	}
	l.rejected.Add(1)
	d.RetryAfter = reset
	return d
}

// Rejected is how many requests were refused since start.
func (l *Limiter) Rejected() uint64 {
	if l == nil {
		return 0
	}
	return l.rejected.Load()
}

// MemoryCounter is a Counter in this process, bounded in size.
type MemoryCounter struct {
	c *otter.Cache[string, *atomic.Int64]
}

// NewMemoryCounter returns an empty counter.
func NewMemoryCounter() *MemoryCounter {
	return &MemoryCounter{c: otter.Must(&otter.Options[string, *atomic.Int64]{
		// One entry per active client and window: 100k clients is a lot
		// of scrapers, and an evicted count only forgives a few requests.
		MaximumSize: 100_000,
		ExpiryCalculator: otter.ExpiryCreatingFunc(func(e otter.Entry[string, *atomic.Int64]) time.Duration {
			return 2 * time.Minute
		}),
	})}
}

// IncrWindow implements Counter.
func (m *MemoryCounter) IncrWindow(_ context.Context, key string, ttl time.Duration) (int64, error) {
	v, _ := m.c.ComputeIfAbsent(key, func() (*atomic.Int64, bool) { return new(atomic.Int64), false })
	if ttl > 0 {
		m.c.SetExpiresAfter(key, ttl)
	}
	return v.Add(1), nil
}

// Close stops the counter's background work.
func (m *MemoryCounter) Close() { m.c.StopAllGoroutines() }
