package dedup

import (
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/hostmatch"
)

// Config is the `dedup:` section of config.yaml. Its top-level settings are
// the default rule; Rules refine them per host, path and method.
type Config struct {
	// Enabled turns deduplication and caching on. Off, every request goes
	// upstream as BYPASS.
	Enabled bool `yaml:"enabled"`
	// TTL is how long a cacheable response is served from the cache. 0
	// means coalesce concurrent duplicates but cache nothing.
	TTL time.Duration `yaml:"ttl"`
	// KeyHeaders are the request headers that select a different response.
	KeyHeaders []string `yaml:"key_headers"`
	// IgnoreParams are query parameters dropped from the key ("utm_*").
	IgnoreParams []string `yaml:"ignore_params"`
	// CacheableStatuses may be cached; 429 and 5xx never are.
	CacheableStatuses []int `yaml:"cacheable_statuses"`
	// MaxBodyBytes is the largest body kept whole in memory: cached in the
	// Store (memory, Redis) as one entry, and held in memory by one
	// flight's spool. Bigger bodies spool to a file and are cached in the
	// disk tier. Default 8 MiB. (It used to be the largest response shared
	// at all; MaxObjectBytes is that now.)
	MaxBodyBytes bytesize.Size `yaml:"max_body_bytes"`
	// MaxObjectBytes is the largest body coalesced and cached. A response
	// that declares a bigger one streams to its own client uncached
	// (BYPASS); one of unknown length that grows past it is relayed to the
	// readers it has, at the pace of the slowest, and not cached. Default
	// 256 MiB.
	MaxObjectBytes bytesize.Size `yaml:"max_object_bytes"`
	// StallTimeout bounds a flight's body once the headers came: an origin
	// that sends no byte for this long fails the download for every
	// reader. Default 30s.
	StallTimeout time.Duration `yaml:"stall_timeout"`
	// SpoolDir is where flights' bodies go once they outgrow memory; each
	// process uses a directory of its own in it, removed on shutdown.
	// Default: onceproxy-spool in the OS temp directory.
	SpoolDir string `yaml:"spool_dir"`
	// SpoolMemoryBytes bounds the memory all flights' spools hold at once;
	// past it, bodies go to files sooner. Default 128 MiB.
	SpoolMemoryBytes bytesize.Size `yaml:"spool_memory_bytes"`
	// SpoolDiskBytes bounds what all flights' spool files hold at once. A
	// body that would take them past it goes on as on a full disk: relayed
	// to the clients already reading it, uncached. Default 4 GiB.
	SpoolDiskBytes bytesize.Size `yaml:"spool_disk_bytes"`
	// Disk is the cache tier for bodies over MaxBodyBytes.
	Disk DiskConfig `yaml:"disk"`
	// MaxRequestBodyBytes is the largest request body read to key a
	// request (POST rules); bigger bodies go upstream as BYPASS.
	MaxRequestBodyBytes bytesize.Size `yaml:"max_request_body_bytes"`
	// FlightTimeout bounds one upstream fetch that others wait on, from
	// the request until its response headers (the body is bounded by
	// StallTimeout). The leader runs detached from its client, so this is
	// what stops a hung origin from holding waiters.
	FlightTimeout time.Duration `yaml:"flight_timeout"`
	// MaxFlights caps upstream fetches running at once in this process.
	// A leader's fetch outlives a client that hangs up (so the others, and
	// the cache, still get the answer); the cap keeps clients that open and
	// abandon requests in a loop (HTTP/2 rapid reset) from piling up
	// detached fetches. Beyond it requests get 503. Default 4096.
	MaxFlights int `yaml:"max_flights"`
	// MaxFlightsPerClient caps the flights one client may lead at once, so
	// one client cannot take every slot of max_flights from the others. The
	// client is the one the front door identified (clientinfo.Info.Client:
	// proxy account, else client IP), the same the rate limit counts.
	// Default a quarter of max_flights.
	MaxFlightsPerClient int `yaml:"max_flights_per_client"`
	// Memory is the in-process cache.
	Memory MemoryConfig `yaml:"memory"`
	// Rules refine the defaults; the first rule that matches a request wins.
	Rules []RuleConfig `yaml:"rules"`
}

// MemoryConfig sizes the in-memory store.
type MemoryConfig struct {
	// MaxBytes bounds the cache by what its entries hold in memory.
	MaxBytes bytesize.Size `yaml:"max_bytes"`
}

// DiskConfig sizes the disk tier.
type DiskConfig struct {
	// Dir is where the tier keeps its files, in a directory of this
	// process's own, removed on shutdown (the tier does not outlive the
	// process). Default: onceproxy in the user's cache directory, else
	// onceproxy-cache in the OS temp directory.
	Dir string `yaml:"dir"`
	// MaxBytes bounds the total size of the files; the least recently
	// used go first. 0 turns the tier off: big bodies are coalesced but
	// not cached.
	MaxBytes bytesize.Size `yaml:"max_bytes"`
}

// RuleConfig is one entry of dedup.rules. Match fields select requests;
// unset settings inherit the defaults above.
type RuleConfig struct {
	// Name identifies the rule in logs and errors.
	Name string `yaml:"name"`
	// Host is a host pattern matched against the request host without
	// port: "api.example.com" exactly, or "*.example.com" for every
	// subdomain at any depth (not example.com itself); case and a trailing
	// dot do not matter. Empty matches any host.
	Host string `yaml:"host"`
	// PathPrefix matches the start of the URL path; empty matches any.
	PathPrefix string `yaml:"path_prefix"`
	// Methods the rule matches. GET and HEAD are always deduplicated when
	// the rule is on; any other method listed here is opted in (its body
	// becomes part of the key). Empty matches every method.
	Methods []string `yaml:"methods"`
	// Dedup false turns deduplication off for matching requests (BYPASS).
	Dedup *bool `yaml:"dedup"`
	// TTL overrides dedup.ttl; 0 means coalesce only.
	TTL *time.Duration `yaml:"ttl"`
	// KeyHeaders overrides dedup.key_headers.
	KeyHeaders []string `yaml:"key_headers"`
	// IgnoreParams overrides dedup.ignore_params.
	IgnoreParams []string `yaml:"ignore_params"`
	// BodyFields keys a form or JSON body on these fields only (a CAPTCHA
	// solver's sitekey and page, not the API key or a nonce).
	BodyFields []string `yaml:"body_fields"`
	// ShareCredentials lets requests with different Authorization, Cookie,
	// headers named like credentials or proxy user share responses. Only
	// for public data.
	ShareCredentials bool `yaml:"share_credentials"`
	// ShareCountries lets requests that ask for different exit countries
	// (user-country-XX, X-Onceproxy-Country) share responses. Only for
	// origins that serve every country the same content.
	ShareCountries bool `yaml:"share_countries"`
	// CacheableStatuses overrides dedup.cacheable_statuses.
	CacheableStatuses []int `yaml:"cacheable_statuses"`
	// CacheSetCookie allows caching responses that set cookies.
	CacheSetCookie bool `yaml:"cache_set_cookie"`
	// CachePrivate allows caching responses marked Cache-Control:
	// no-store or private.
	CachePrivate bool `yaml:"cache_private"`
}

// Defaults used by WithDefaults.
var (
	DefaultTTL               = 45 * time.Second
	DefaultCacheableStatuses = []int{200, 203, 204, 300, 301, 308, 404, 410}
)

// DefaultDiskBytes is disk.max_bytes as config.yaml ships it. The zero
// value turns the disk tier off, so WithDefaults leaves it alone.
const DefaultDiskBytes = 1 * bytesize.GiB

// WithDefaults returns c with unset fields filled in. A nil list means the
// default list; an explicit empty list means none.
func (c Config) WithDefaults() Config {
	if c.KeyHeaders == nil {
		c.KeyHeaders = slices.Clone(DefaultHeaders)
	}
	if c.IgnoreParams == nil {
		c.IgnoreParams = slices.Clone(DefaultIgnoreParams)
	}
	if c.CacheableStatuses == nil {
		c.CacheableStatuses = slices.Clone(DefaultCacheableStatuses)
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = 8 * bytesize.MiB
	}
	if c.MaxObjectBytes == 0 {
		c.MaxObjectBytes = max(256*bytesize.MiB, c.MaxBodyBytes)
	}
	if c.StallTimeout == 0 {
		c.StallTimeout = 30 * time.Second
	}
	if c.SpoolDir == "" {
		c.SpoolDir = filepath.Join(os.TempDir(), "onceproxy-spool")
	}
	if c.SpoolMemoryBytes == 0 {
		c.SpoolMemoryBytes = 128 * bytesize.MiB
	}
	if c.SpoolDiskBytes == 0 {
		c.SpoolDiskBytes = 4 * bytesize.GiB
	}
	if c.Disk.Dir == "" {
		c.Disk.Dir = defaultDiskDir()
	}
	if c.MaxRequestBodyBytes == 0 {
		c.MaxRequestBodyBytes = 1 * bytesize.MiB
	}
	if c.FlightTimeout == 0 {
		c.FlightTimeout = 60 * time.Second
	}
	if c.MaxFlights == 0 {
		c.MaxFlights = 4096
	}
	if c.MaxFlightsPerClient == 0 {
		c.MaxFlightsPerClient = max(c.MaxFlights/4, 1)
	}
	if c.Memory.MaxBytes == 0 {
		c.Memory.MaxBytes = 256 * bytesize.MiB
	}
	return c
}

// maxTTL bounds a ttl: an entry's expiry is kept in int64 nanoseconds,
// which end in 2262, and one past that wraps round to before 1678, an
// entry expired as it is stored.
const maxTTL = 100 * 365 * 24 * time.Hour

// maxFlightTimeout bounds flight_timeout: a fleet waiter gives up after it
// plus a margin (joinFleet), a sum that near time.Duration's end
// (2562047h) wrapped round below zero, so that every waiter gave up at
// once. A day to response headers is past any real origin.
const maxFlightTimeout = 24 * time.Hour

func checkTTL(ttl time.Duration) error {
	switch {
	case ttl < 0:
		return fmt.Errorf("ttl: must not be negative, got %s", ttl)
	case ttl > maxTTL:
		return fmt.Errorf("ttl: must be at most %s (100 years), got %s", maxTTL, ttl)
	}
	return nil
}

// Validate reports every problem in c, each prefixed with its yaml key.
func (c Config) Validate() error {
	var errs []error
	if err := checkTTL(c.TTL); err != nil {
		errs = append(errs, err)
	}
	errs = append(errs, checkStatuses("cacheable_statuses", c.CacheableStatuses)...)
	errs = append(errs, checkHeaders("key_headers", c.KeyHeaders)...)
	if c.MaxBodyBytes < 1024 {
		errs = append(errs, fmt.Errorf("max_body_bytes: must be at least 1KiB, got %s", c.MaxBodyBytes))
	}
	if c.MaxBodyBytes > 1*bytesize.GiB {
		errs = append(errs, fmt.Errorf("max_body_bytes: must be at most 1GiB, got %s", c.MaxBodyBytes))
	}
	if c.MaxObjectBytes < c.MaxBodyBytes {
		errs = append(errs, fmt.Errorf("max_object_bytes: must be at least max_body_bytes (%s), got %s", c.MaxBodyBytes, c.MaxObjectBytes))
	}
	if c.StallTimeout < 0 {
		errs = append(errs, fmt.Errorf("stall_timeout: must not be negative, got %s", c.StallTimeout))
	}
	if c.SpoolMemoryBytes < 0 {
		errs = append(errs, fmt.Errorf("spool_memory_bytes: must not be negative, got %s", c.SpoolMemoryBytes))
	}
	if c.SpoolDiskBytes < 0 {
		errs = append(errs, fmt.Errorf("spool_disk_bytes: must not be negative, got %s", c.SpoolDiskBytes))
	}
	if c.Disk.MaxBytes < 0 {
		errs = append(errs, fmt.Errorf("disk.max_bytes: must not be negative, got %s", c.Disk.MaxBytes))
	}
	if c.MaxRequestBodyBytes < 1024 {
		errs = append(errs, fmt.Errorf("max_request_body_bytes: must be at least 1KiB, got %s", c.MaxRequestBodyBytes))
	}
	if c.MaxFlights < 1 {
		errs = append(errs, fmt.Errorf("max_flights: must be at least 1, got %d", c.MaxFlights))
	}
	if c.MaxFlightsPerClient < 1 || c.MaxFlightsPerClient > c.MaxFlights {
		errs = append(errs, fmt.Errorf("max_flights_per_client: must be between 1 and max_flights (%d), got %d", c.MaxFlights, c.MaxFlightsPerClient))
	}
	if c.FlightTimeout <= 0 {
		errs = append(errs, fmt.Errorf("flight_timeout: must be positive, got %s", c.FlightTimeout))
	}
	if c.FlightTimeout > maxFlightTimeout {
		errs = append(errs, fmt.Errorf("flight_timeout: must be at most %s (a fleet waiter's deadline adds 5s to it), got %s", maxFlightTimeout, c.FlightTimeout))
	}
	if c.Memory.MaxBytes < c.MaxBodyBytes {
		errs = append(errs, fmt.Errorf("memory.max_bytes: must be at least max_body_bytes (%s), got %s", c.MaxBodyBytes, c.Memory.MaxBytes))
	}
	// A rule's name is how logs and errors tell it apart (Rule.Name): two
	// rules of one name would pass for each other. An unnamed rule is
	// "rules[i]" (compileRules), as upstream.rules names it.
	named := map[string]string{}
	for i, r := range c.Rules {
		key := fmt.Sprintf("rules[%d]", i)
		for _, err := range r.validate() {
			errs = append(errs, fmt.Errorf("%s%s.%w", key, ruleLabel(r), err))
		}
		name := r.Name
		if name == "" {
			name = key
		}
		if first, ok := named[name]; ok {
			errs = append(errs, fmt.Errorf("%s%s.name: %q is already used by %s", key, ruleLabel(r), name, first))
		} else {
			named[name] = key
		}
	}
	return errors.Join(errs...)
}

// defaultDiskDir is a directory meant for caches when the user has one
// (os.UserCacheDir: $XDG_CACHE_HOME, ~/.cache): the OS temp directory is
// often a RAM disk, which would make the disk tier memory.
func defaultDiskDir() string {
	if d, err := os.UserCacheDir(); err == nil {
		return filepath.Join(d, "onceproxy")
	}
	return filepath.Join(os.TempDir(), "onceproxy-cache")
}

func ruleLabel(r RuleConfig) string {
	if r.Name == "" {
		return ""
	}
	return fmt.Sprintf("(%s)", r.Name)
}

func (r RuleConfig) validate() []error {
	var errs []error
	if r.Host != "" {
		if err := hostmatch.Valid(r.Host); err != nil {
			errs = append(errs, fmt.Errorf("host: %w", err))
		}
	}
	if r.PathPrefix != "" && !strings.HasPrefix(r.PathPrefix, "/") {
		errs = append(errs, fmt.Errorf("path_prefix: must start with '/', got %q", r.PathPrefix))
	}
	for i, m := range r.Methods {
		if m == "" || strings.ToUpper(m) != m || strings.ContainsAny(m, " \t/") {
			errs = append(errs, fmt.Errorf("methods[%d]: %q is not an upper-case HTTP method", i, m))
		}
		if m == http.MethodConnect {
			errs = append(errs, fmt.Errorf("methods[%d]: CONNECT cannot be deduplicated", i))
		}
	}
	if r.TTL != nil {
		if err := checkTTL(*r.TTL); err != nil {
			errs = append(errs, err)
		}
	}
	errs = append(errs, checkStatuses("cacheable_statuses", r.CacheableStatuses)...)
	errs = append(errs, checkHeaders("key_headers", r.KeyHeaders)...)
	for i, f := range r.BodyFields {
		if f == "" {
			errs = append(errs, fmt.Errorf("body_fields[%d]: empty field name", i))
		}
	}
	return errs
}

func checkStatuses(key string, codes []int) []error {
	var errs []error
	for i, s := range codes {
		switch {
		case s < 100 || s > 599:
			errs = append(errs, fmt.Errorf("%s[%d]: %d is not an HTTP status", key, i, s))
		case s == http.StatusTooManyRequests || s >= 500:
			errs = append(errs, fmt.Errorf("%s[%d]: %d is never cacheable (rate limits and server errors must be retried, not replayed)", key, i, s))
		case s < 200:
			errs = append(errs, fmt.Errorf("%s[%d]: %d is an interim response, not cacheable", key, i, s))
		}
	}
	return errs
}

func checkHeaders(key string, names []string) []error {
	var errs []error
	for i, h := range names {
		if h == "" || strings.ContainsAny(h, " \t:") {
			errs = append(errs, fmt.Errorf("%s[%d]: %q is not a header name", key, i, h))
		}
	}
	return errs
}
