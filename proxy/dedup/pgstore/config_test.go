package pgstore

import (
	"math"
	"strings"
	"testing"
	"time"
)

// TestConfigValidateBounds: a value PostgreSQL or pgxpool cannot take is
// refused naming its key. flight_conns near the int maximum used to pass
// (flight_conns + 2 wrapped round below max_conns) and then allocated a
// lock session per connection at start-up; max_conns past the int32
// maximum was truncated into pgxpool's MaxConns (2^32 + 4 became a pool of
// one); a timeout past 2^31-1 ms made every connection fail on its
// statement_timeout.
func TestConfigValidateBounds(t *testing.T) {
	for _, tc := range []struct {
		name string
		set  func(*Config)
		want string
	}{
		{"flight_conns overflowing max_conns", func(c *Config) { c.FlightConns = math.MaxInt }, "flight_conns:"},
		{"flight_conns above max_conns", func(c *Config) { c.FlightConns, c.MaxConns = 9, 10 }, "max_conns:"},
		{"max_conns past int32", func(c *Config) { c.MaxConns = 1<<32 + 4 }, "max_conns:"},
		{"max_conns at the int minimum", func(c *Config) { c.MaxConns = math.MinInt }, "max_conns:"},
		{"timeout past statement_timeout", func(c *Config) { c.Timeout = 1000 * time.Hour }, "timeout:"},
		// The breaker counts in 32 bits: 2^32 became 0, a breaker that
		// opened on the first failed statement.
		{"breaker_failures past uint32", func(c *Config) { c.BreakerFailures = 1 << 32 }, "breaker_failures: must be at most 4294967295"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Config{URL: "postgres://x/y"}.WithDefaults()
			tc.set(&c)
			err := c.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Validate() = %v, want an error naming %s", err, tc.want)
			}
		})
	}
	c := Config{URL: "postgres://x/y", MaxConns: maxBackends, FlightConns: maxBackends - 2, Timeout: maxStatementTimeout}.WithDefaults()
	if err := c.Validate(); err != nil {
		t.Errorf("the largest values PostgreSQL takes: %v", err)
	}
}
