// Package ratelimit keeps one client from flooding the proxy: N requests
// per window per client, counted in this process or, when Redis or
// PostgreSQL is configured, across the fleet. Who the client is (its proxy
// account, else its IP) is the front door's decision
// (clientinfo.Info.Client); the limiter only counts. It also offers
// Polite, a per-target-host pace for upstream requests.
//
// The allowance is a generic cell rate algorithm (GCRA, a token bucket
// kept as one time per client): a burst of N at once, then one request
// every window/N. A fixed window counter, the obvious alternative, lets
// a client send N at the end of one window and N more at the start of the
// next: twice the limit within a moment, which is what a limit is there
// to stop. GCRA keeps one number per client, so the fleet's counter is
// still one key and one atomic step per request (Counter).
package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"time"

	"github.com/maypok86/otter/v2"

	"github.com/seed-a3c387e8/onceproxy/internal/hostmatch"
)

// Config is the `rate_limit:` section of config.yaml.
type Config struct {
	// Requests allowed per client per window; 0 turns client limits off.
	Requests int `yaml:"requests"`
	// Window is the time over which Requests are allowed: a client may
	// send Requests at once, then one every Window/Requests. Default 1m.
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
	} else if c.Requests > 0 && c.Window/time.Duration(c.Requests) < time.Microsecond {
		// The shared counters keep time in microseconds.
		errs = append(errs, fmt.Errorf("requests: %d per %s is more than one per microsecond", c.Requests, c.Window))
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

// Counter keeps each client's place in its allowance. Take admits one
// request under key unless the key is more than burst ahead of now once
// the request adds interval to it (GCRA): an admitted request moves the
// key's time on by interval (from now, when it lags behind now), a
// refused one moves nothing. It returns how far ahead of now the key is
// after the call. The memory counter is in this package; the fleet's are
// rediscache.Bus and pgstore.Bus, which keep time by the store's clock so
// that every instance agrees.
type Counter interface {
	Take(ctx context.Context, key string, interval, burst time.Duration) (ahead time.Duration, ok bool, err error)
}

// Limiter decides per request. Create it with New.
type Limiter struct {
	set      atomic.Pointer[limits] // replaced whole by Reconfigure
	counter  Counter
	own      *MemoryCounter // the counter New made, closed by Close
	rejected atomic.Uint64
	failed   atomic.Uint64
}

// New returns a limiter counting in counter (nil: in this process).
func New(cfg Config, counter Counter) (*Limiter, error) {
	l := &Limiter{counter: counter}
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
// the configuration): each client keeps its place in the allowance, and
// the new limits measure it from then on. It fails, changing nothing, for
// an invalid cfg.
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
	RetryAfter time.Duration // until the next request would be admitted, when refused
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
	w, n := set.cfg.Window, set.cfg.Requests
	interval := w / time.Duration(n)
	ahead, ok, err := l.counter.Take(ctx, "gcra:"+client, interval, w)
	if err != nil {
		l.failed.Add(1)
		if set.cfg.FailClosed {
			return Decision{Allowed: false, Limit: n, RetryAfter: interval, Unavailable: true}
		}
		return Decision{Allowed: true, Limit: n, Unavailable: true}
	}
	ahead = min(max(ahead, 0), w)
	d := Decision{Allowed: ok, Limit: n, Remaining: int((w - ahead) / interval)}
	if ok {
		return d
	}
	l.rejected.Add(1)
	// The key moves back to now at one second a second: the next
	// request fits once it is no more than w-interval ahead.
	d.RetryAfter = max(ahead+interval-w, time.Millisecond)
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
	c   *otter.Cache[string, *atomic.Int64] // a key's time, in ns since the epoch
	now func() time.Time
}

// NewMemoryCounter returns an empty counter.
func NewMemoryCounter() *MemoryCounter {
	return &MemoryCounter{now: time.Now, c: otter.Must(&otter.Options[string, *atomic.Int64]{
		// One entry per client active within its window: 100k clients is
		// a lot of scrapers, and an evicted one only gets a fresh burst.
		MaximumSize: 100_000,
		ExpiryCalculator: otter.ExpiryCreatingFunc(func(e otter.Entry[string, *atomic.Int64]) time.Duration {
			return 2 * time.Minute
		}),
	})}
}

// Take implements Counter.
func (m *MemoryCounter) Take(_ context.Context, key string, interval, burst time.Duration) (time.Duration, bool, error) {
	now := m.now().UnixNano()
	v, _ := m.c.ComputeIfAbsent(key, func() (*atomic.Int64, bool) { return new(atomic.Int64), false })
	for {
		at := v.Load()
		next := max(at, now) + int64(interval)
		if next-now > int64(burst) {
			return time.Duration(max(at, now) - now), false, nil
		}
		if v.CompareAndSwap(at, next) {
			// Once the key's time has passed it holds nothing a new
			// entry would not: let it go then.
			m.c.SetExpiresAfter(key, time.Duration(next-now)+time.Second)
			return time.Duration(next - now), true, nil
		}
	}
}

// Close stops the counter's background work.
func (m *MemoryCounter) Close() { m.c.StopAllGoroutines() }
