package proxy

import (
	"errors"
	"fmt"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/hostmatch"
	"github.com/seed-a3c387e8/onceproxy/internal/listenaddr"
)

// Config is the `proxy:` section of config.yaml. Zero values mean the
// documented defaults (see WithDefaults).
type Config struct {
	// Listen is the HTTP proxy address (absolute-form requests and CONNECT).
	Listen string `yaml:"listen"`
	// MaxConns caps concurrent client connections, tunnels included. Default 4096.
	MaxConns int `yaml:"max_conns"`
	// MaxConnsPerClient caps the connections one client may hold, so that
	// one client cannot take every slot: by client address when accepted,
	// and by proxy account once a CONNECT or request authenticates on the
	// HTTP port. Default half of MaxConns; -1 turns it off.
	MaxConnsPerClient int `yaml:"max_conns_per_client"`
	// ReadHeaderTimeout bounds reading a request's headers, on the proxy port
	// and inside intercepted tunnels (and the first byte of a tunnel).
	// Default 10s.
	ReadHeaderTimeout time.Duration `yaml:"read_header_timeout"`
	// IdleTimeout drops a client connection or tunnel on which nothing moved
	// for this long, or which took nothing sent to it for this long
	// (whatever it sent meanwhile), and resets an intercepted HTTP/2
	// stream whose response has not moved for this long. Default 2m.
	IdleTimeout time.Duration `yaml:"idle_timeout"`
	// MaxHeaderBytes caps a request's header size, on the proxy port and
	// inside intercepted tunnels. Default 64 KiB.
	MaxHeaderBytes int `yaml:"max_header_bytes"`
	// DialTimeout bounds opening a blind tunnel (bypass hosts). Default 15s.
	DialTimeout time.Duration `yaml:"dial_timeout"`
	// ShutdownGrace is how long in-flight requests may finish after SIGTERM
	// before remaining connections are cut. Default 20s.
	ShutdownGrace time.Duration `yaml:"shutdown_grace"`
	// BypassHosts are tunnelled without interception (certificate-pinned
	// apps, hosts you must not decrypt): host patterns, exact names or
	// "*.example.com" for every subdomain.
	BypassHosts []string `yaml:"bypass_hosts"`
	// TrustForwardedFor identifies a client without an account by the
	// address a balancer in front of the proxy reports (the last
	// X-Forwarded-For entry, else X-Real-IP) instead of the connection's,
	// for the rate limit and the per-client flight cap alike. Only behind
	// a balancer you control: clients can send these headers themselves.
	// Inside a tunnel the CONNECT decides; the requests it carries cannot
	// change who they come from. Default false.
	TrustForwardedFor bool `yaml:"trust_forwarded_for"`
}

// WithDefaults returns c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.Listen == "" {
		c.Listen = "127.0.0.1:8080"
	}
	if c.MaxConns == 0 {
		c.MaxConns = 4096
	}
	if c.MaxConnsPerClient == 0 {
		c.MaxConnsPerClient = max(c.MaxConns/2, 1)
	}
	if c.ReadHeaderTimeout == 0 {
		c.ReadHeaderTimeout = 10 * time.Second
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = 2 * time.Minute
	}
	if c.MaxHeaderBytes == 0 {
		c.MaxHeaderBytes = 64 << 10
	}
	if c.DialTimeout == 0 {
		c.DialTimeout = 15 * time.Second
	}
	if c.ShutdownGrace == 0 {
		c.ShutdownGrace = 20 * time.Second
	}
	return c
}

// Validate reports every problem in c, each prefixed with its yaml key.
func (c Config) Validate() error {
	var errs []error
	if err := listenaddr.Check(c.Listen); err != nil {
		errs = append(errs, fmt.Errorf("listen: %w", err))
	}
	if c.MaxConns < 1 {
		errs = append(errs, fmt.Errorf("max_conns: must be at least 1, got %d", c.MaxConns))
	}
	if c.MaxConnsPerClient < -1 || c.MaxConnsPerClient > c.MaxConns {
		errs = append(errs, fmt.Errorf("max_conns_per_client: must be -1 (off) or 1 to max_conns (%d), got %d", c.MaxConns, c.MaxConnsPerClient))
	}
	if c.MaxHeaderBytes < 4096 {
		errs = append(errs, fmt.Errorf("max_header_bytes: must be at least 4096, got %d", c.MaxHeaderBytes))
	}
	for _, d := range []struct {
		key string
		v   time.Duration
	}{
		{"read_header_timeout", c.ReadHeaderTimeout},
		{"idle_timeout", c.IdleTimeout},
		{"dial_timeout", c.DialTimeout},
		{"shutdown_grace", c.ShutdownGrace},
	} {
		if d.v <= 0 {
			errs = append(errs, fmt.Errorf("%s: must be positive, got %s", d.key, d.v))
		}
	}
	for i, h := range c.BypassHosts {
		if err := hostmatch.Valid(h); err != nil {
			errs = append(errs, fmt.Errorf("bypass_hosts[%d]: %w", i, err))
		}
	}
	return errors.Join(errs...)
}
