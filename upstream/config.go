package upstream

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/hostmatch"
	"github.com/seed-a3c387e8/onceproxy/internal/redact"
)

// Config is the `upstream:` section of config.yaml. Zero values mean the
// documented defaults (see WithDefaults).
type Config struct {
	// URL of one static upstream proxy, kept from the single-upstream days:
	// http://user:pass@host:port or socks5://user:pass@host:port becomes a
	// session with id "default" (sticky, weight 5). Empty, with no sessions
	// and no provider, means direct.
	URL string `yaml:"url"`
	// DialTimeout bounds one TCP connect, to the origin or to the upstream
	// proxy, including the CONNECT / SOCKS5 handshake. Default 10s.
	DialTimeout time.Duration `yaml:"dial_timeout"`
	// TLSHandshakeTimeout bounds the TLS handshake with an origin. Default 10s.
	TLSHandshakeTimeout time.Duration `yaml:"tls_handshake_timeout"`
	// ResponseHeaderTimeout bounds the wait for an origin's response headers
	// after the request was written. Default 30s.
	ResponseHeaderTimeout time.Duration `yaml:"response_header_timeout"`
	// IdleTimeout drops an origin connection or tunnel on which nothing moved
	// for this long, including a body that stalls mid-transfer, and resets
	// an HTTP/2 response body that brought nothing for this long (its
	// connection may be busy with other streams). Default 2m.
	IdleTimeout time.Duration `yaml:"idle_timeout"`
	// IdleConnTimeout closes pooled keep-alive connections unused this long. Default 90s.
	IdleConnTimeout time.Duration `yaml:"idle_conn_timeout"`
	// PingTimeout checks an HTTP/2 origin connection that has read nothing
	// for this long: its next request goes out behind a PING, and when
	// nothing comes back within PingTimeout the connection is closed and
	// the request (one that may be repeated) goes out on a new one. A
	// connection a NAT or gateway dropped silently would otherwise hold
	// the request for response_header_timeout. Default 10s, as Chromium.
	PingTimeout time.Duration `yaml:"ping_timeout"`
	// MaxIdleConnsPerHost caps pooled keep-alive connections per origin and
	// session. Default 512 (at most MaxIdleConns): a pool smaller than the
	// requests in flight to one origin closes what a burst opened and opens
	// it again for the next, a TCP and TLS handshake per request (with 512
	// HTTP/1.1 clients on a 200ms origin, 32 made a miss cost 1.8x the CPU;
	// onceload -compare -compare-latency 200ms -c 512).
	MaxIdleConnsPerHost int `yaml:"max_idle_conns_per_host"`
	// MaxIdleConns caps pooled keep-alive connections per session, over
	// every origin: an idle TLS connection holds about 60 KiB. Default 1024.
	MaxIdleConns int `yaml:"max_idle_conns"`
	// CAFiles are PEM files of extra certificate authorities trusted for
	// origins (and the provider API), on top of the system roots.
	CAFiles []string `yaml:"ca_files"`
	// InsecureSkipVerifyHosts lists origin host names (exact, or "*.example.com")
	// whose certificates are NOT verified. Every entry is logged as a warning
	// at start-up. Empty by default; never use it for hosts you don't own.
	InsecureSkipVerifyHosts []string `yaml:"insecure_skip_verify_hosts"`

	// Sessions are upstream proxy sessions listed by hand: a provider's
	// sticky sessions whose credentials you know, or plain proxies. Default
	// none.
	Sessions []SessionConfig `yaml:"sessions"`
	// Provider lists (and rotates) sessions through a rotating-proxy
	// provider's API. Off when provider.api is empty (the default). It is
	// the one-provider shorthand of Providers (its sessions keep the ids
	// the API gives them); set one or the other.
	Provider ProviderConfig `yaml:"provider"`
	// Providers are several providers, each with its own API, sessions,
	// priority and prices. Requests go to the highest-priority provider
	// with a session that can take them, and fail over to the next when
	// its sessions all cool down, its API keeps failing or its gateway
	// refuses connections. A listed session's id is "NAME.ID". Default
	// none.
	Providers []ProviderConfig `yaml:"providers"`
	// Health probes every session actively. Off when health.url is empty
	// (the default); passive marks from real traffic always apply.
	Health HealthConfig `yaml:"health"`
	// Retry bounds the retries of one request on a new exit IP.
	Retry RetryConfig `yaml:"retry"`
	// WhenExhausted says what happens when every session is cooling down:
	// "fail" (default) answers 503 with the reason; "direct" sends the
	// request from this host's own address, logged as an error.
	WhenExhausted string `yaml:"when_exhausted"`
	// Rules refine session choice, ban detection and retries per target;
	// the first rule that matches a request wins. Default none.
	Rules []RuleConfig `yaml:"rules"`
	// Fingerprint is how origin connections of intercepted clients look:
	// "mirror" (default) opens them with the client's own TLS ClientHello,
	// HTTP version, HTTP/2 settings and header order; "go" with Go's
	// (net/http). Requests without a captured fingerprint (the /fetch API,
	// health probes) and protocol switches always go out the Go way.
	Fingerprint string `yaml:"fingerprint"`
}

// SessionConfig is one entry of upstream.sessions.
type SessionConfig struct {
	// ID names the session in X-Onceproxy-Upstream, logs and the admin
	// API, and is the id used with the provider's rotate API; clients
	// name it in X-Onceproxy-Session or their user name
	// (user-session-ID). Required: 1-64 characters of letters, digits,
	// '_', '-' and '.'.
	ID string `yaml:"id"`
	// URL is the gateway with this session's credentials:
	// http://USER:PASS@HOST:PORT or socks5://USER:PASS@HOST:PORT. Required.
	URL string `yaml:"url"`
	// Rotation is how the provider changes this session's exit IP:
	// "sticky" (default: only when rotated), "timed" (every interval) or
	// "per_request" (every new connection, so every request gets its own
	// connection).
	Rotation string `yaml:"rotation"`
	// Interval is the rotation period of a "timed" session. Required for
	// timed, not allowed otherwise.
	Interval time.Duration `yaml:"interval"`
	// Weight 1-10 is the session's share of traffic and its starting
	// health weight. Default 5.
	Weight int `yaml:"weight"`
	// Country is where the session's exit IP is (an ISO 3166-1 alpha-2
	// code): requests that ask for a country go only to its sessions.
	// Default none: the session serves requests that ask for no country.
	Country string `yaml:"country"`
	// City narrows Country ("berlin"), for requests that ask for a city.
	City string `yaml:"city"`
	// Provider names an entry of providers whose priority, prices and
	// rotate API the session shares. Default: the hand-listed sessions
	// are a group of their own, named "sessions", at priority 0, priced
	// by the savings section (rotated by the provider when there is
	// exactly one).
	Provider string `yaml:"provider"`
}

// ProviderConfig is upstream.provider, or one entry of upstream.providers:
// a RoProxy-style session API.
type ProviderConfig struct {
	// Name labels the provider in logs, metrics, the admin API and its
	// sessions' ids ("NAME.ID"): 1-32 letters, digits, '_' or '-'.
	// Required in providers; the shorthand's is "default".
	Name string `yaml:"name"`
	// API is the base URL of the provider API (https://backend.example);
	// sessions are listed with GET {api}/api/session and rotated with
	// POST {api}/api/session/{id}/rotate. Empty (default) turns it off.
	API string `yaml:"api"`
	// APIKey is sent as "Authorization: Bearer APIKEY". Prefer APIKeyEnv
	// so the key need not sit in the file. Default empty.
	APIKey string `yaml:"api_key"`
	// APIKeyEnv names an environment variable holding the API key.
	// Default empty.
	APIKeyEnv string `yaml:"api_key_env"`
	// Protocol picks the gateway port of listed sessions: "http"
	// (default: http_port) or "socks5" (socks5_port).
	Protocol string `yaml:"protocol"`
	// Refresh is how often the session list is fetched again. Default 5m.
	Refresh time.Duration `yaml:"refresh"`
	// Timeout bounds one API call. Default 10s.
	Timeout time.Duration `yaml:"timeout"`
	// Priority orders providers: the highest one with a session that can
	// take a request gets it; equal priorities share traffic. Default 0
	// (the hand-listed sessions' group too).
	Priority int `yaml:"priority"`
	// PricePerGB and PricePer1000Requests are what this provider bills,
	// for the savings report; unset ones are the savings section's.
	PricePerGB           *float64 `yaml:"price_per_gb"`
	PricePer1000Requests *float64 `yaml:"price_per_1000_requests"`
	// Countries, when set, are the only countries this provider serves
	// requests for (ISO 3166-1 alpha-2); a listed session without a
	// country of its own is in the only one when there is one. Default:
	// the countries its sessions say they are in.
	Countries []string `yaml:"countries"`
	// MaxSessions caps the sessions taken from the API: a longer list is
	// cut to its first MaxSessions by id, the same ones on every
	// instance, with a warning. Each session is a series of every
	// onceproxy_upstream_session_* metric and a transport of its own; an
	// answer listing tens of thousands (a big account, an API someone
	// else controls) must not make as many. Default DefaultMaxSessions.
	MaxSessions int `yaml:"max_sessions"`
}

// DefaultMaxSessions is ProviderConfig.MaxSessions's default.
const DefaultMaxSessions = 1000

// maxProviderTimeout bounds a provider's timeout: a rotation's claim on the
// fleet lasts rotationQuiet plus it (claimRotation), a sum that near
// time.Duration's end (2562047h) wrapped round below zero, a lifetime no
// claim can have. A day is past any real API call.
const maxProviderTimeout = 24 * time.Hour

// HealthConfig is upstream.health: active probes through every session.
type HealthConfig struct {
	// URL is fetched (GET) through every session; "" (default) turns
	// active checks off. An answer that is a bare IP address, or JSON with
	// "ip" or "origin" (ipify, httpbin), also tells the session's exit IP.
	URL string `yaml:"url"`
	// Interval between two rounds of probes. Default 30s.
	Interval time.Duration `yaml:"interval"`
	// Timeout bounds one probe. Default 10s.
	Timeout time.Duration `yaml:"timeout"`
}

// RetryConfig is upstream.retry.
type RetryConfig struct {
	// MaxAttempts is the most times one request is sent, the first
	// included (1 = never retry). Default 3.
	MaxAttempts int `yaml:"max_attempts"`
	// Methods may be retried after a 429, a ban, a 5xx or a connection
	// error. Default [GET, HEAD]. A request that provably never left (the
	// gateway refused the connection) is retried whatever its method.
	Methods []string `yaml:"methods"`
}

// RuleConfig is one entry of upstream.rules.
type RuleConfig struct {
	// Name labels the rule in logs and is its rate bucket for
	// sticky: account_rule. Default "rules[N]".
	Name string `yaml:"name"`
	// Host is a host pattern matched against the request's host name
	// without port: "api.example.com" exactly, or "*.example.com" for
	// every subdomain at any depth (not example.com itself); case and a
	// trailing dot do not matter. Empty matches every host.
	Host string `yaml:"host"`
	// PathPrefix restricts the rule to paths starting with it. Empty
	// matches every path.
	PathPrefix string `yaml:"path_prefix"`
	// Sticky keeps requests on one session per bucket: "none" (default),
	// "host" (per target host), "account" (per proxy account) or
	// "account_rule" (per proxy account and this rule, the rate bucket of
	// APIs that count requests per token and per IP).
	Sticky string `yaml:"sticky"`
	// BanStatuses are response statuses that mean "this exit IP is banned"
	// on top of 429 (e.g. [403]). Default none.
	BanStatuses []int `yaml:"ban_statuses"`
	// BanBody is a substring that means "banned" when found in the first
	// 64 KiB of a response body (decoded when gzip, deflate, br or zstd).
	// The body still reaches the client intact. Default none.
	BanBody string `yaml:"ban_body"`
	// RetryMethods overrides retry.methods for this rule. Default: inherit.
	RetryMethods []string `yaml:"retry_methods"`
	// Fingerprint overrides the pool's fingerprint ("mirror" or "go") for
	// this rule's requests. Default: inherit.
	Fingerprint string `yaml:"fingerprint"`
	// Country is the exit country (ISO 3166-1 alpha-2) of the rule's
	// requests that ask for none themselves (user-country-XX or
	// X-Onceproxy-Country win). Default none.
	Country string `yaml:"country"`
}

// Rotation modes.
const (
	RotationSticky     = "sticky"
	RotationTimed      = "timed"
	RotationPerRequest = "per_request"
)

// Sticky buckets of a rule.
const (
	StickyNone        = "none"
	StickyHost        = "host"
	StickyAccount     = "account"
	StickyAccountRule = "account_rule"
)

// Fingerprint modes.
const (
	FingerprintMirror = "mirror"
	FingerprintGo     = "go"
)

// WhenExhausted values.
const (
	ExhaustedFail   = "fail"
	ExhaustedDirect = "direct"
)

// defaultSessionID is the id of the session made from Config.URL.
const defaultSessionID = "default"

// Weight bounds and the default weight of a session.
const (
	minWeight     = 1
	maxWeight     = 10
	defaultWeight = 5
	// defaultMaxIdleConns is max_idle_conns when unset.
	defaultMaxIdleConns = 1024
)

// WithDefaults returns c with zero fields set to their defaults. Slices are
// copied before being filled in, so the caller's config is never modified.
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
	def(&c.PingTimeout, 10*time.Second)
	if c.MaxIdleConns == 0 {
		c.MaxIdleConns = defaultMaxIdleConns
	}
	if c.MaxIdleConnsPerHost == 0 {
		c.MaxIdleConnsPerHost = min(512, max(c.MaxIdleConns, 1))
	}
	c.Sessions = slices.Clone(c.Sessions)
	for i := range c.Sessions {
		s := &c.Sessions[i]
		if s.Rotation == "" {
			s.Rotation = RotationSticky
		}
		if s.Weight == 0 {
			s.Weight = defaultWeight
		}
	}
	c.Provider = c.Provider.withDefaults()
	if c.Provider.Name == "" {
		c.Provider.Name = shorthandName
	}
	c.Providers = slices.Clone(c.Providers)
	for i := range c.Providers {
		c.Providers[i] = c.Providers[i].withDefaults()
	}
	def(&c.Health.Interval, 30*time.Second)
	def(&c.Health.Timeout, 10*time.Second)
	if c.Retry.MaxAttempts == 0 {
		c.Retry.MaxAttempts = 3
	}
	if c.Retry.Methods == nil {
		c.Retry.Methods = []string{http.MethodGet, http.MethodHead}
	}
	if c.WhenExhausted == "" {
		c.WhenExhausted = ExhaustedFail
	}
	if c.Fingerprint == "" {
		c.Fingerprint = FingerprintMirror
	}
	c.Rules = slices.Clone(c.Rules)
	for i := range c.Rules {
		if c.Rules[i].Sticky == "" {
			c.Rules[i].Sticky = StickyNone
		}
	}
	return c
}

func (p ProviderConfig) withDefaults() ProviderConfig {
	if p.Protocol == "" {
		p.Protocol = "http"
	}
	if p.Refresh == 0 {
		p.Refresh = 5 * time.Minute
	}
	if p.Timeout == 0 {
		p.Timeout = 10 * time.Second
	}
	if p.MaxSessions == 0 {
		p.MaxSessions = DefaultMaxSessions
	}
	return p
}

// shorthandName names the provider of upstream.provider; staticName the
// group of hand-listed sessions that name no provider.
const (
	shorthandName = "default"
	staticName    = "sessions"
)

// apiProviders returns the configured providers with an API: the
// shorthand, or the list. Call on a config with defaults.
func (c Config) apiProviders() []ProviderConfig {
	if c.Provider.API != "" {
		return []ProviderConfig{c.Provider}
	}
	return c.Providers
}

// Validate reports every problem in c, each prefixed with its key path
// relative to upstream. ("sessions[2].url: ..."). Zero values are checked
// as the defaults they stand for. getenv reads provider.api_key_env (the
// environment the program was given; nil means os.Getenv).
func (c Config) Validate(getenv func(string) string) error {
	if getenv == nil {
		getenv = os.Getenv
	}
	c = c.WithDefaults()
	var errs []error
	add := func(key string, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", key, fmt.Sprintf(format, args...)))
	}
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
		{"ping_timeout", c.PingTimeout},
		{"health.interval", c.Health.Interval},
		{"health.timeout", c.Health.Timeout},
	} {
		if d.v < 0 {
			add(d.key, "must not be negative, got %s", d.v)
		}
	}
	if c.MaxIdleConnsPerHost < 0 {
		add("max_idle_conns_per_host", "must not be negative, got %d", c.MaxIdleConnsPerHost)
	}
	if c.MaxIdleConns < 0 {
		add("max_idle_conns", "must not be negative, got %d", c.MaxIdleConns)
	}
	if total := cmp.Or(c.MaxIdleConns, defaultMaxIdleConns); total > 0 && c.MaxIdleConnsPerHost > total {
		add("max_idle_conns_per_host", "%d is more than max_idle_conns (%d) lets a session keep", c.MaxIdleConnsPerHost, total)
	}
	for i, f := range c.CAFiles {
		if _, err := os.Stat(f); err != nil {
			errs = append(errs, fmt.Errorf("ca_files[%d]: %w", i, err))
		}
	}
	for i, h := range c.InsecureSkipVerifyHosts {
		if err := hostmatch.Valid(h); err != nil {
			errs = append(errs, fmt.Errorf("insecure_skip_verify_hosts[%d]: %w", i, err))
		}
	}

	seen := map[string]string{}
	if c.URL != "" {
		seen[defaultSessionID] = "url"
	}
	for i, s := range c.Sessions {
		key := fmt.Sprintf("sessions[%d]", i)
		idErr := clientinfo.ValidateSessionID(s.ID)
		switch {
		case idErr != nil:
			errs = append(errs, fmt.Errorf("%s.id: %w", key, idErr))
		case seen[s.ID] != "":
			add(key+".id", "%q is already used by %s", s.ID, seen[s.ID])
		default:
			seen[s.ID] = key
		}
		if s.URL == "" {
			add(key+".url", "required")
		} else if _, err := parseProxyURL(s.URL); err != nil {
			errs = append(errs, fmt.Errorf("%s.url: %w", key, err))
		}
		errs = append(errs, validateRotation(key, s.Rotation, s.Interval)...)
		if s.Weight < minWeight || s.Weight > maxWeight {
			add(key+".weight", "must be %d-%d, got %d", minWeight, maxWeight, s.Weight)
		}
	}

	names := map[string]bool{}
	if c.Provider.API != "" && len(c.Providers) > 0 {
		add("providers", "set provider (one provider) or providers, not both")
	}
	if c.Provider.API != "" || len(c.Providers) == 0 {
		errs = append(errs, c.Provider.validate("provider", false, getenv)...)
	}
	for i, pc := range c.Providers {
		key := fmt.Sprintf("providers[%d]", i)
		errs = append(errs, pc.validate(key, true, getenv)...)
		if names[pc.Name] {
			add(key+".name", "%q is already used by another provider", pc.Name)
		}
		names[pc.Name] = true
	}
	for i, sc := range c.Sessions {
		key := fmt.Sprintf("sessions[%d]", i)
		if sc.Country != "" {
			if _, err := clientinfo.ParseCountry(sc.Country); err != nil {
				errs = append(errs, fmt.Errorf("%s.country: %w", key, err))
			}
		}
		if sc.City != "" {
			if _, err := clientinfo.ParseCity(sc.City); err != nil {
				errs = append(errs, fmt.Errorf("%s.city: %w", key, err))
			}
		}
		if sc.Provider != "" && !names[sc.Provider] {
			add(key+".provider", "%q is not the name of an entry of providers", sc.Provider)
		}
	}

	if c.Health.URL != "" {
		if u, err := url.Parse(c.Health.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			add("health.url", "must be an absolute http(s) URL, got %q", redact.URL(c.Health.URL))
		}
		if c.Health.Interval == 0 {
			add("health.interval", "must be positive")
		}
		if c.Health.Timeout == 0 {
			add("health.timeout", "must be positive")
		}
	}

	if c.Retry.MaxAttempts < 1 || c.Retry.MaxAttempts > 10 {
		add("retry.max_attempts", "must be 1-10, got %d", c.Retry.MaxAttempts)
	}
	errs = append(errs, validateMethods("retry.methods", c.Retry.Methods)...)

	switch c.WhenExhausted {
	case ExhaustedFail, ExhaustedDirect:
	default:
		add("when_exhausted", "must be %q or %q, got %q", ExhaustedFail, ExhaustedDirect, c.WhenExhausted)
	}
	if err := validFingerprint(c.Fingerprint); err != nil {
		add("fingerprint", "%v", err)
	}

	// A rule's name is its rate bucket for sticky: account_rule: two rules
	// of one name would share every account's session between them.
	named := map[string]string{}
	for i, r := range c.Rules {
		key := fmt.Sprintf("rules[%d]", i)
		name := r.Name
		if name == "" {
			name = key // compileRules' default
		}
		if first, ok := named[name]; ok {
			add(key+".name", "%q is already used by %s", name, first)
		} else {
			named[name] = key
		}
		if r.Host != "" {
			if err := hostmatch.Valid(r.Host); err != nil {
				errs = append(errs, fmt.Errorf("%s.host: %w", key, err))
			}
		}
		if r.PathPrefix != "" && !strings.HasPrefix(r.PathPrefix, "/") {
			add(key+".path_prefix", "must start with '/', got %q", r.PathPrefix)
		}
		switch r.Sticky {
		case StickyNone, StickyHost, StickyAccount, StickyAccountRule:
		default:
			add(key+".sticky", "must be none, host, account or account_rule, got %q", r.Sticky)
		}
		for j, st := range r.BanStatuses {
			if st < 100 || st > 599 {
				add(fmt.Sprintf("%s.ban_statuses[%d]", key, j), "%d is not an HTTP status", st)
			}
		}
		errs = append(errs, validateMethods(key+".retry_methods", r.RetryMethods)...)
		if r.Fingerprint != "" {
			if err := validFingerprint(r.Fingerprint); err != nil {
				add(key+".fingerprint", "%v", err)
			}
		}
		if r.Country != "" {
			if _, err := clientinfo.ParseCountry(r.Country); err != nil {
				errs = append(errs, fmt.Errorf("%s.country: %w", key, err))
			}
		}
	}
	return errors.Join(errs...)
}

func validFingerprint(mode string) error {
	switch mode {
	case FingerprintMirror, FingerprintGo:
		return nil
	}
	return fmt.Errorf("must be %q or %q, got %q", FingerprintMirror, FingerprintGo, mode)
}

// validate checks one provider under key ("provider", "providers[1]");
// listed: an entry of providers, which needs a name and an API.
func (p ProviderConfig) validate(key string, listed bool, getenv func(string) string) []error {
	var errs []error
	add := func(k string, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s.%s: %s", key, k, fmt.Sprintf(format, args...)))
	}
	// The shorthand's name, when set, is checked as a listed one's: it
	// labels the same metrics and starts its sessions' ids ("" is
	// "default").
	if listed || p.Name != "" {
		if err := validateProviderName(p.Name); err != nil {
			errs = append(errs, fmt.Errorf("%s.name: %w", key, err))
		}
	}
	if listed && p.API == "" {
		add("api", "required")
	}
	if p.Name == staticName && (listed || p.API != "") {
		// The pool indexes its groups by name: a provider of this name
		// would take the hand-listed sessions' place.
		add("name", "%q names the group of hand-listed sessions; choose another name", p.Name)
	}
	if p.Refresh < 0 {
		add("refresh", "must not be negative, got %s", p.Refresh)
	}
	if p.Timeout < 0 {
		add("timeout", "must not be negative, got %s", p.Timeout)
	}
	if p.Timeout > maxProviderTimeout {
		add("timeout", "must be at most %s (a rotation's fleet claim adds 5s to it), got %s", maxProviderTimeout, p.Timeout)
	}
	if p.MaxSessions < 0 {
		add("max_sessions", "must be positive, got %d", p.MaxSessions)
	}
	if p.API != "" {
		// The calls append their paths to api: a query or a fragment
		// would swallow them.
		if u, err := url.Parse(p.API); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil ||
			u.RawQuery != "" || u.ForceQuery || u.Fragment != "" {
			add("api", "must be an http(s) URL with a host and no credentials, query or fragment, got %q", redact.URL(p.API))
		}
		switch {
		case p.APIKey != "" && p.APIKeyEnv != "":
			add("api_key", "set api_key or api_key_env, not both")
		case p.APIKey == "" && p.APIKeyEnv == "":
			add("api_key", "required when %s.api is set (or name a variable in %s.api_key_env)", key, key)
		case p.APIKeyEnv != "" && getenv(p.APIKeyEnv) == "":
			add("api_key_env", "environment variable %s is unset or empty", p.APIKeyEnv)
		}
		if p.Refresh == 0 {
			add("refresh", "must be positive")
		}
		if p.Timeout == 0 {
			add("timeout", "must be positive")
		}
	}
	if p.Protocol != "http" && p.Protocol != "socks5" {
		add("protocol", "must be http or socks5, got %q", p.Protocol)
	}
	for _, pr := range []struct {
		k string
		v *float64
	}{{"price_per_gb", p.PricePerGB}, {"price_per_1000_requests", p.PricePer1000Requests}} {
		if pr.v != nil && (*pr.v < 0 || math.IsNaN(*pr.v) || math.IsInf(*pr.v, 0)) {
			add(pr.k, "must be a price of 0 or more, got %v", *pr.v)
		}
	}
	for i, c := range p.Countries {
		if _, err := clientinfo.ParseCountry(c); err != nil {
			errs = append(errs, fmt.Errorf("%s.countries[%d]: %w", key, i, err))
		}
	}
	return errs
}

// validateProviderName: a provider's name starts its sessions' ids, so it
// is a short session-id-safe word without '.' (which ends it).
func validateProviderName(name string) error {
	if name == "" {
		return errors.New("required")
	}
	if len(name) > 32 {
		return fmt.Errorf("%.16q... is longer than 32 bytes", name)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return fmt.Errorf("%q: %q is not allowed (letters, digits, '_' and '-' only)", name, c)
		}
	}
	return nil
}

func validateRotation(key, rotation string, interval time.Duration) []error {
	var errs []error
	switch rotation {
	case RotationSticky, RotationPerRequest:
		if interval != 0 {
			errs = append(errs, fmt.Errorf("%s.interval: only for rotation: timed", key))
		}
	case RotationTimed:
		if interval <= 0 {
			errs = append(errs, fmt.Errorf("%s.interval: required (positive) for rotation: timed", key))
		}
	default:
		errs = append(errs, fmt.Errorf("%s.rotation: must be sticky, timed or per_request, got %q", key, rotation))
	}
	return errs
}

func validateMethods(key string, methods []string) []error {
	var errs []error
	for i, m := range methods {
		if m == "" || strings.ToUpper(m) != m || strings.ContainsAny(m, " \t/:") {
			errs = append(errs, fmt.Errorf("%s[%d]: %q is not an upper-case HTTP method", key, i, m))
		}
	}
	return errs
}

// apiKey returns the provider API key from the file or from the
// environment getenv reads.
func (p ProviderConfig) apiKey(getenv func(string) string) string {
	if p.APIKeyEnv != "" {
		return getenv(p.APIKeyEnv)
	}
	return p.APIKey
}

// parseProxyURL checks an upstream proxy URL: scheme http or socks5 (socks5h
// is accepted as an alias: host names are always resolved by the upstream),
// a host and a port.
func parseProxyURL(raw string) (*url.URL, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("parse %q: %w", redact.URL(raw), redact.Error(err, raw))
	}
	switch u.Scheme {
	case "http", "socks5", "socks5h":
	default:
		return nil, fmt.Errorf("%s: scheme must be http, socks5 or socks5h, got %q", redact.URL(raw), u.Scheme)
	}
	if u.Hostname() == "" {
		return nil, fmt.Errorf("%s: missing host", redact.URL(raw))
	}
	if u.Port() == "" {
		return nil, fmt.Errorf("%s: missing port", redact.URL(raw))
	}
	if _, _, err := net.SplitHostPort(u.Host); err != nil {
		return nil, fmt.Errorf("%s: %w", redact.URL(raw), err)
	}
	// url.Parse takes any digits for a port; a dial refuses 0 and past
	// 65535, which would fail every request sent through the session.
	if p, err := strconv.Atoi(u.Port()); err != nil || p < 1 || p > 65535 {
		return nil, fmt.Errorf("%s: port must be 1-65535, got %s", redact.URL(raw), u.Port())
	}
	if u.Path != "" && u.Path != "/" || u.RawQuery != "" {
		return nil, fmt.Errorf("%s: must not have a path or query", redact.URL(raw))
	}
	if u.Scheme == "socks5h" {
		u.Scheme = "socks5"
	}
	if u.Scheme == "socks5" && u.User != nil {
		pass, _ := u.User.Password()
		if err := checkSOCKSCredentials(u.User.Username(), pass); err != nil {
			return nil, fmt.Errorf("%s: %w", redact.URL(raw), err)
		}
	}
	u.Path = ""
	return u, nil
}
