package dedup

import (
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"
)

func TestConfigValidate(t *testing.T) {
	neg := -time.Second
	for _, tc := range []struct {
		name string
		cfg  Config
		want []string
	}{
		{"defaults", Config{}, nil},
		{"everything wrong", Config{
			TTL:               -1,
			CacheableStatuses: []int{200, 429, 503, 100, 999},
			KeyHeaders:        []string{"Accept", "bad header"},
			MaxBodyBytes:      10,
			MaxObjectBytes:    5,
			StallTimeout:      -1,
			SpoolMemoryBytes:  -1,
			Disk:              DiskConfig{MaxBytes: -1},
			FlightTimeout:     -1,
			Rules: []RuleConfig{
				{Name: "r0", Host: "[", PathPrefix: "no-slash", Methods: []string{"post", "CONNECT"}, TTL: &neg, BodyFields: []string{""}},
			},
		}, []string{
			"ttl:", "cacheable_statuses[1]: 429", "cacheable_statuses[2]: 503", "cacheable_statuses[3]: 100",
			"cacheable_statuses[4]: 999", "key_headers[1]:", "max_body_bytes:", "flight_timeout:",
			"max_object_bytes:", "stall_timeout:", "spool_memory_bytes:", "disk.max_bytes:",
			"rules[0](r0).host:", "rules[0](r0).path_prefix:", "rules[0](r0).methods[0]:", "rules[0](r0).methods[1]:",
			"rules[0](r0).ttl:", "rules[0](r0).body_fields[0]:",
		}},
		// Logs and errors tell rules apart by name: two of one name were
		// accepted and passed for each other. An unnamed rule is
		// "rules[i]"; two unnamed ones stay allowed.
		{"rule names", Config{Rules: []RuleConfig{
			{Name: "api", Host: "a.example"}, {Host: "b.example"}, {Host: "c.example"}, {Name: "api", Host: "d.example"},
			{Name: "rules[1]", Host: "e.example"},
		}}, []string{`rules[3](api).name: "api" is already used by rules[0]`, `rules[4](rules[1]).name: "rules[1]" is already used by rules[1]`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg
			if tc.want == nil {
				cfg = cfg.WithDefaults()
			} else {
				cfg.Memory.MaxBytes = 1 << 30
				if cfg.MaxRequestBodyBytes == 0 {
					cfg.MaxRequestBodyBytes = 1 << 20
				}
			}
			err := cfg.Validate()
			if tc.want == nil {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("missing %q in:\n%v", w, err)
				}
			}
		})
	}
}

func TestRuleMatching(t *testing.T) {
	rs := compileRules(Config{Enabled: true, TTL: time.Minute, Rules: []RuleConfig{
		{Name: "captcha", Host: "2captcha.com", PathPrefix: "/in.php", Methods: []string{"POST"}},
		{Name: "captcha-sub", Host: "*.2captcha.com", PathPrefix: "/in.php", Methods: []string{"POST"}},
		{Name: "api", Host: "api.example.com"},
		{Name: "shop", Host: "*.shop.test"},
		{Name: "any-checkout", PathPrefix: "/checkout", Dedup: ptr(false)},
	}}.WithDefaults())
	for _, tc := range []struct{ method, url, want string }{
		{"POST", "https://2captcha.com/in.php", "captcha"},
		{"POST", "https://api.2captcha.com/in.php?x=1", "captcha-sub"},
		{"POST", "https://evil2captcha.com/in.php", "default"},
		{"GET", "https://2captcha.com/in.php", "default"},
		{"GET", "https://API.Example.com:8443/v1", "api"},
		{"GET", "https://api.example.com./v1", "api"},
		{"GET", "https://a.b.shop.test/x", "shop"},
		{"GET", "https://shop.test/x", "default"},
		{"GET", "https://www.example.com/checkout/pay", "any-checkout"},
		{"GET", "https://api.example.com/checkout", "api"}, // first match wins
		{"GET", "https://other.test/", "default"},
		// The path the key names decides, dot-segments and escapes
		// resolved as urlcanon.Path resolves them.
		{"GET", "https://www.example.com/x/../checkout/pay", "any-checkout"},
		{"GET", "https://www.example.com/x/%2E%2E/checkout/pay", "any-checkout"},
		{"GET", "https://www.example.com/checkout/../cart", "default"},
		{"GET", "https://www.example.com/%63heckout/pay", "any-checkout"},
	} {
		u, _ := url.Parse(tc.url)
		r := rs.match(&http.Request{Method: tc.method, URL: u})
		if r.Name() != tc.want {
			t.Errorf("%s %s matched %q, want %q", tc.method, tc.url, r.Name(), tc.want)
		}
	}
	if rs.list[4].dedups("GET") || !rs.list[0].dedups("POST") || rs.def.dedups("POST") || !rs.def.dedups("HEAD") {
		t.Error("dedups() wrong")
	}
}

func TestAcceptsCoding(t *testing.T) {
	for _, tc := range []struct {
		ae     []string
		coding string
		want   bool
	}{
		{nil, "gzip", false},
		{nil, "identity", true},
		{[]string{"gzip"}, "gzip", true},
		{[]string{"x-gzip"}, "gzip", true},
		{[]string{"GZIP;q=0.5"}, "gzip", true},
		{[]string{"gzip;q=0"}, "gzip", false},
		{[]string{"br", "gzip"}, "gzip", true},
		{[]string{"*"}, "zstd", true},
		{[]string{"*;q=0"}, "identity", false},
		{[]string{"identity;q=0", "gzip"}, "identity", false},
		{[]string{"gzip"}, "identity", true},
		{[]string{"deflate, br;q=1.0"}, "br", true},
	} {
		if got := acceptsCoding(tc.ae, tc.coding); got != tc.want {
			t.Errorf("acceptsCoding(%q, %q) = %v", tc.ae, tc.coding, got)
		}
	}
}

// TestConfigValidateTTLBound: an entry's expiry is kept in int64
// nanoseconds, which end in 2262; a ttl reaching past it made the expiry
// wrap round to before 1678, so nothing was ever served from the cache
// and nothing said so. A ttl past 100 years is refused, at the top and in
// a rule.
func TestConfigValidateTTLBound(t *testing.T) {
	huge := 2_100_000 * time.Hour // 2026 + 239 years: past 2262
	err := Config{TTL: huge, Rules: []RuleConfig{{Name: "r0", TTL: &huge}}}.WithDefaults().Validate()
	for _, want := range []string{"ttl: must be at most 876000h0m0s (100 years)", "rules[0](r0).ttl: must be at most 876000h0m0s (100 years)"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ttl %s: %v, want %q", huge, err, want)
		}
	}
	long := maxTTL
	if err := (Config{TTL: long, Rules: []RuleConfig{{Name: "r0", TTL: &long}}}).WithDefaults().Validate(); err != nil {
		t.Errorf("ttl of 100 years: %v", err)
	}
}
