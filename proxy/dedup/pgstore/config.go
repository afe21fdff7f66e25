package pgstore

import (
	"errors"
	"fmt"
	"math"
	"regexp"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
)

// Config is the `postgres:` section of config.yaml. With no URL, onceproxy
// runs alone on its memory store (or shares Redis, configured apart).
type Config struct {
	// URL of the database: postgres://user:pass@host:5432/db?sslmode=...
	// The conventional DATABASE_URL variable fills it.
	URL string `yaml:"url"`
	// Schema holds onceproxy's tables, created on first start. Default
	// "onceproxy". Fleets that must not share get a schema each.
	Schema string `yaml:"schema"`
	// MaxConns is this instance's whole budget of connections: the pool
	// for short statements, FlightConns, and one listener. Default 10.
	MaxConns int `yaml:"max_conns"`
	// FlightConns is how many connections hold the locks of the flights
	// this instance leads, part of MaxConns: each holds any number, and
	// its statements (take a lock, end a flight) take turns. Default 2.
	FlightConns int `yaml:"flight_conns"`
	// FlightLocks bounds the flights this instance leads with a lock at
	// once; beyond it a new flight leads without one. Every advisory lock
	// takes a slot of the server's shared lock table
	// (max_locks_per_transaction × max_connections: 6,400 by default),
	// which the whole fleet shares. Default 512.
	FlightLocks int `yaml:"flight_locks"`
	// DialTimeout bounds connecting. Default 500ms.
	DialTimeout time.Duration `yaml:"dial_timeout"`
	// Timeout bounds each statement (statement_timeout, and the client's
	// wait). Default 250ms.
	Timeout time.Duration `yaml:"timeout"`
	// BreakerFailures consecutive failed statements open the circuit
	// breaker. Default 3.
	BreakerFailures int `yaml:"breaker_failures"`
	// BreakerInterval is how long the database is skipped once the breaker
	// opens, before one probe. Default 5s.
	BreakerInterval time.Duration `yaml:"breaker_interval"`
	// PollInterval is how often the instance re-checks, in one statement,
	// every key it waits on: the safety net when a notification is lost,
	// and how soon its waiters notice a dead leader. Default 100ms.
	PollInterval time.Duration `yaml:"poll_interval"`
	// FailureTTL keeps a failed or uncacheable flight's outcome for its
	// waiters. Default 5s.
	FailureTTL time.Duration `yaml:"failure_ttl"`
	// MaxValueBytes caps one stored value (after compression); bigger
	// responses are cached by this instance only. Default 2MiB.
	MaxValueBytes bytesize.Size `yaml:"max_value_bytes"`
	// MaxBytes bounds the shared cache table (the values' bytes); the
	// oldest rows go first. Default 1GiB.
	MaxBytes bytesize.Size `yaml:"max_bytes"`
	// SweepInterval is how often one instance of the fleet deletes
	// expired rows and evicts past MaxBytes. Default 10s.
	SweepInterval time.Duration `yaml:"sweep_interval"`
	// LocalTTL caps how long a value read from the database stays in
	// this process's memory tier. Default 2s.
	LocalTTL time.Duration `yaml:"local_ttl"`
	// StatsFlush is how often this instance adds its counters to the
	// fleet's per-day statistics. Default 1s.
	StatsFlush time.Duration `yaml:"stats_flush"`
}

// Enabled reports whether a database is configured.
func (c Config) Enabled() bool { return c.URL != "" }

// WithDefaults returns c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.Schema == "" {
		c.Schema = "onceproxy"
	}
	set := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	set(&c.DialTimeout, 500*time.Millisecond)
	set(&c.Timeout, 250*time.Millisecond)
	set(&c.BreakerInterval, 5*time.Second)
	set(&c.PollInterval, 100*time.Millisecond)
	set(&c.FailureTTL, 5*time.Second)
	set(&c.SweepInterval, 10*time.Second)
	set(&c.LocalTTL, 2*time.Second)
	set(&c.StatsFlush, time.Second)
	if c.MaxConns == 0 {
		c.MaxConns = 10
	}
	if c.FlightConns == 0 {
		c.FlightConns = 2
	}
	if c.FlightLocks == 0 {
		c.FlightLocks = 512
	}
	if c.BreakerFailures == 0 {
		c.BreakerFailures = 3
	}
	if c.MaxValueBytes == 0 {
		c.MaxValueBytes = 2 * bytesize.MiB
	}
	if c.MaxBytes == 0 {
		c.MaxBytes = bytesize.GiB
	}
	return c
}

// maxBackends is the most connections a PostgreSQL server takes
// (max_connections is capped at MAX_BACKENDS, 2^18-1). It also keeps
// max_conns and flight_conns inside pgxpool's int32 MaxConns.
const maxBackends = 1<<18 - 1

// maxStatementTimeout is the largest statement_timeout PostgreSQL accepts
// (an int of milliseconds): past it every connection is refused.
const maxStatementTimeout = math.MaxInt32 * time.Millisecond

// maxDialTimeout bounds dial_timeout. The deadlines of the calls add it to
// timeout (stepBound) and a lease's end waits 3 × it plus 7 × timeout
// (finishBound): near time.Duration's end (2562047h) those sums wrapped
// round below zero, so every call's deadline had passed before it began.
// A connect takes seconds; a day is past any real one.
const maxDialTimeout = 24 * time.Hour

// schemaName is what a schema may be called: a plain lower-case
// identifier, short enough for the channel name built from it.
var schemaName = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,47}$`)

// Validate reports every problem in c, each prefixed with its yaml key.
func (c Config) Validate() error {
	var errs []error
	if c.URL != "" {
		if _, err := pgxpool.ParseConfig(c.URL); err != nil {
			errs = append(errs, fmt.Errorf("url: %w", err))
		}
	}
	if !schemaName.MatchString(c.Schema) {
		errs = append(errs, fmt.Errorf("schema: %q must be a lower-case identifier (a-z, 0-9, _) of at most 48 characters", c.Schema))
	} else if strings.HasPrefix(c.Schema, "pg_") {
		errs = append(errs, fmt.Errorf("schema: %q starts with pg_, which PostgreSQL reserves for its own schemas", c.Schema))
	}
	for _, d := range []struct {
		key string
		v   time.Duration
	}{
		{"dial_timeout", c.DialTimeout}, {"timeout", c.Timeout}, {"breaker_interval", c.BreakerInterval},
		{"poll_interval", c.PollInterval}, {"failure_ttl", c.FailureTTL}, {"sweep_interval", c.SweepInterval},
		{"local_ttl", c.LocalTTL}, {"stats_flush", c.StatsFlush},
	} {
		if d.v <= 0 {
			errs = append(errs, fmt.Errorf("%s: must be positive, got %s", d.key, d.v))
		}
	}
	if c.Timeout > 0 && c.Timeout < time.Millisecond {
		errs = append(errs, fmt.Errorf("timeout: must be at least 1ms (statement_timeout counts milliseconds), got %s", c.Timeout))
	}
	if c.DialTimeout > maxDialTimeout {
		errs = append(errs, fmt.Errorf("dial_timeout: must be at most %s (every call's deadline adds it to timeout, a lease's end 3 × it to 7 × timeout), got %s", maxDialTimeout, c.DialTimeout))
	}
	if c.Timeout > maxStatementTimeout {
		errs = append(errs, fmt.Errorf("timeout: must be at most %s (statement_timeout is a 32-bit count of milliseconds), got %s", maxStatementTimeout, c.Timeout))
	}
	if c.FlightConns < 1 {
		errs = append(errs, fmt.Errorf("flight_conns: must be at least 1, got %d", c.FlightConns))
	}
	if c.FlightLocks < 1 {
		errs = append(errs, fmt.Errorf("flight_locks: must be at least 1, got %d", c.FlightLocks))
	}
	// One listener, the lock sessions, and at least one pooled
	// connection for everything else. flight_conns is bounded first, so
	// that flight_conns + 2 cannot wrap round below max_conns.
	if c.FlightConns > maxBackends-2 {
		errs = append(errs, fmt.Errorf("flight_conns: must be at most %d (PostgreSQL's %d connections less the listener and one pooled connection), got %d", maxBackends-2, maxBackends, c.FlightConns))
	} else if c.MaxConns < c.FlightConns+2 {
		errs = append(errs, fmt.Errorf("max_conns: must be at least flight_conns + 2 (%d: the listener and one pooled connection), got %d", c.FlightConns+2, c.MaxConns))
	}
	if c.MaxConns > maxBackends {
		errs = append(errs, fmt.Errorf("max_conns: must be at most %d, the most connections PostgreSQL serves, got %d", maxBackends, c.MaxConns))
	}
	if c.BreakerFailures < 1 {
		errs = append(errs, fmt.Errorf("breaker_failures: must be at least 1, got %d", c.BreakerFailures))
	} else if c.BreakerFailures > math.MaxUint32 {
		// The breaker counts consecutive failures in a uint32.
		errs = append(errs, fmt.Errorf("breaker_failures: must be at most %d, got %d", uint32(math.MaxUint32), c.BreakerFailures))
	}
	if c.MaxValueBytes < 1024 {
		errs = append(errs, fmt.Errorf("max_value_bytes: must be at least 1KiB, got %s", c.MaxValueBytes))
	}
	if c.MaxBytes < c.MaxValueBytes {
		errs = append(errs, fmt.Errorf("max_bytes: must hold at least one value of max_value_bytes (%s), got %s", c.MaxValueBytes, c.MaxBytes))
	}
	return errors.Join(errs...)
}

// poolConns is the size of the pool for short statements.
func (c Config) poolConns() int { return c.MaxConns - c.FlightConns - 1 }
