package upstream

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"time"
)

// Config is the `upstream:` section of config.yaml. Zero values mean the
// documented defaults (see WithDefaults).
type Config struct {
	// URL of one upstream proxy that every request leaves through:
	// http://user:pass@host:port (HTTP CONNECT / absolute-form) or
	// socks5://user:pass@host:port. Empty means direct.
	URL string `yaml:"url"`
	// DialTimeout bounds one TCP connect, to the origin or to the upstream proxy. Default 10s.
	DialTimeout time.Duration `yaml:"dial_timeout"`
	// TLSHandshakeTimeout bounds the TLS handshake with an origin. Default 10s.
	TLSHandshakeTimeout time.Duration `yaml:"tls_handshake_timeout"`
	// ResponseHeaderTimeout bounds the wait for an origin's response headers
	// after the request was written. Default 30s.
	ResponseHeaderTimeout time.Duration `yaml:"response_header_timeout"`
	// IdleTimeout drops an origin connection or tunnel on which nothing moved
	// for this long, including a body that stalls mid-transfer. Default 2m.
	IdleTimeout time.Duration `yaml:"idle_timeout"`
	// IdleConnTimeout closes pooled keep-alive connections unused this long. Default 90s.
	IdleConnTimeout time.Duration `yaml:"idle_conn_timeout"`
	// MaxIdleConnsPerHost caps pooled keep-alive connections per origin. Default 32.
	MaxIdleConnsPerHost int `yaml:"max_idle_conns_per_host"`
	// CAFiles are PEM files of extra certificate authorities trusted for
	// origins, on top of the system roots (a private origin, a test origin).
	CAFiles []string `yaml:"ca_files"`
	// InsecureSkipVerifyHosts lists origin host names (exact, or "*.example.com")
	// whose certificates are NOT verified. Every entry is logged as a warning
	// at start-up. Empty by default; never use it for hosts you don't own.
	InsecureSkipVerifyHosts []string `yaml:"insecure_skip_verify_hosts"`
}

// WithDefaults returns c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	def(&c.DialTimeout, 10*time.Second)
	def(&c.TLSHandshakeTimeout, 10*time.Second)
	def(&c.ResponseHeaderTimeout, 30*time.Second)
	def(&c.IdleTimeout, 2*time.Minute)
	def(&c.IdleConnTimeout, 90*time.Second)
	if c.MaxIdleConnsPerHost == 0 {
		c.MaxIdleConnsPerHost = 32
	}
	return c
}

// Validate reports every problem in c, each prefixed with its yaml key.
func (c Config) Validate() error {
	var errs []error
	if c.URL != "" {
		if _, err := parseProxyURL(c.URL); err != nil {
			errs = append(errs, fmt.Errorf("url: %w", err))
		}
	}
	for _, d := range []struct {
		key string
		v   time.Duration
	}{
		{"dial_timeout", c.DialTimeout},
		{"tls_handshake_timeout", c.TLSHandshakeTimeout},
		{"response_header_timeout", c.ResponseHeaderTimeout},
		{"idle_timeout", c.IdleTimeout},
		{"idle_conn_timeout", c.IdleConnTimeout},
	} {
		if d.v < 0 {
			errs = append(errs, fmt.Errorf("%s: must not be negative, got %s", d.key, d.v))
		}
	}
	if c.MaxIdleConnsPerHost < 0 {
		errs = append(errs, fmt.Errorf("max_idle_conns_per_host: must not be negative, got %d", c.MaxIdleConnsPerHost))
	}
	for i, f := range c.CAFiles {
		if _, err := os.Stat(f); err != nil {
			errs = append(errs, fmt.Errorf("ca_files[%d]: %w", i, err))
		}
	}
	for i, h := range c.InsecureSkipVerifyHosts {
		if h == "" || strings.ContainsAny(h, "/: ") || strings.Contains(strings.TrimPrefix(h, "*."), "*") {
			errs = append(errs, fmt.Errorf("insecure_skip_verify_hosts[%d]: %q is not a host name or *.domain pattern", i, h))
		}
	}
	return errors.Join(errs...)
}

// parseProxyURL checks an upstream proxy URL: scheme http or socks5 (socks5h
// is accepted as an alias: host names are always resolved by the upstream),
// a host and a port.
func parseProxyURL(raw string) (*url.URL, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("parse %q: %w", redact(raw), err)
	}
	switch u.Scheme {
	case "http", "socks5", "socks5h":
	default:
		return nil, fmt.Errorf("%s: scheme must be http, socks5 or socks5h, got %q", redact(raw), u.Scheme)
	}
	if u.Hostname() == "" {
		return nil, fmt.Errorf("%s: missing host", redact(raw))
	}
	if u.Port() == "" {
		return nil, fmt.Errorf("%s: missing port", redact(raw))
	}
	if _, _, err := net.SplitHostPort(u.Host); err != nil {
		return nil, fmt.Errorf("%s: %w", redact(raw), err)
	}
	if u.Path != "" && u.Path != "/" || u.RawQuery != "" {
		return nil, fmt.Errorf("%s: must not have a path or query", redact(raw))
	}
	if u.Scheme == "socks5h" {
		u.Scheme = "socks5"
	}
	return u, nil
}

// redact hides the password of a proxy URL so it never reaches a log or an
// error message a client can see.
func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.User == nil {
		if i := strings.LastIndex(raw, "@"); i >= 0 {
			return "<redacted>@" + raw[i+1:]
		}
		return raw
	}
	return u.Redacted()
}
