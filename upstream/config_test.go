package upstream_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

func TestConfigDefaults(t *testing.T) {
	in := upstream.Config{
		Sessions: []upstream.SessionConfig{{ID: "a", URL: "http://u:p@gw:1"}},
		Rules:    []upstream.RuleConfig{{Host: "x"}},
	}
	c := in.WithDefaults()
	if c.Sessions[0].Rotation != "sticky" || c.Sessions[0].Weight != 5 ||
		c.Provider.Protocol != "http" || c.Provider.Refresh != 5*time.Minute || c.Provider.Timeout != 10*time.Second ||
		c.Health.URL != "" || c.Health.Interval != 30*time.Second || c.Health.Timeout != 10*time.Second ||
		c.Retry.MaxAttempts != 3 || strings.Join(c.Retry.Methods, ",") != "GET,HEAD" ||
		c.WhenExhausted != "fail" || c.Rules[0].Sticky != "none" {
		t.Fatalf("defaults: %+v", c)
	}
	if in.Sessions[0].Rotation != "" || in.Rules[0].Sticky != "" {
		t.Fatal("WithDefaults modified the caller's slices")
	}
	// The pool keeps what a burst of 512 requests to one origin opened;
	// a smaller total bounds the per-origin default with it.
	if c.MaxIdleConns != 1024 || c.MaxIdleConnsPerHost != 512 {
		t.Errorf("idle pool defaults: %d per origin, %d in all", c.MaxIdleConnsPerHost, c.MaxIdleConns)
	}
	if c := (upstream.Config{MaxIdleConns: 100}).WithDefaults(); c.MaxIdleConnsPerHost != 100 {
		t.Errorf("max_idle_conns 100: per origin %d, want 100", c.MaxIdleConnsPerHost)
	}
}

func TestConfigValidateUpstreamKeys(t *testing.T) {
	// The environment the program was given, not the process's.
	env := map[string]string{"ONCEPROXY_TEST_KEY": "k", "ONCEPROXY_TEST_EMPTY_KEY": ""}
	getenv := func(k string) string { return env[k] }
	ok := upstream.Config{
		Sessions: []upstream.SessionConfig{
			{ID: "s1", URL: "http://u:p@gw.example:8000"},
			{ID: "s-2.b", URL: "socks5://u:p@gw.example:1080", Rotation: "timed", Interval: time.Minute, Weight: 10},
			{ID: "s3", URL: "socks5h://gw.example:1080", Rotation: "per_request", Weight: 1},
		},
		Provider: upstream.ProviderConfig{API: "https://api.example", APIKeyEnv: "ONCEPROXY_TEST_KEY", Protocol: "socks5"},
		Health:   upstream.HealthConfig{URL: "https://api.ipify.org"},
		Retry:    upstream.RetryConfig{MaxAttempts: 5, Methods: []string{"GET", "HEAD", "OPTIONS"}},
		Rules: []upstream.RuleConfig{{Name: "api", Host: "*.shop.example", PathPrefix: "/api/", Sticky: "account_rule",
			BanStatuses: []int{403}, BanBody: "captcha", RetryMethods: []string{"GET", "POST"}}},
		WhenExhausted: "direct",
	}
	if err := ok.Validate(getenv); err != nil {
		t.Fatalf("valid config rejected: %v", err)
	}
	for _, tc := range []struct {
		name string
		cfg  upstream.Config
		want []string
	}{
		{"session problems", upstream.Config{URL: "http://u:p@gw:1", Sessions: []upstream.SessionConfig{
			{ID: "", URL: "http://u:secret@gw:1"},
			{ID: "default", URL: "http://gw:1"},
			{ID: "a", URL: ""},
			{ID: "a", URL: "ftp://u:secret@gw:1", Rotation: "sometimes"},
			{ID: "b", URL: "http://gw:1", Rotation: "timed"},
			{ID: "c", URL: "http://gw:1", Interval: time.Second},
			{ID: "d", URL: "http://u:secret@gw", Weight: 11},
			{ID: "bad id", URL: "http://gw:1"},
			// A port no dial takes: it used to pass and fail every
			// request sent through the session.
			{ID: "e", URL: "http://u:secret@gw:99999"},
			{ID: "f", URL: "socks5://gw:0"},
		}}, []string{
			"sessions[0].id: session id is empty",
			`sessions[1].id: "default" is already used by url`,
			"sessions[2].url: required",
			`sessions[3].id: "a" is already used by sessions[2]`,
			"sessions[3].url: ", "scheme",
			"sessions[3].rotation: must be sticky, timed or per_request",
			"sessions[4].interval: required (positive) for rotation: timed",
			"sessions[5].interval: only for rotation: timed",
			"sessions[6].url: ", "missing port",
			"sessions[6].weight: must be 1-10, got 11",
			`sessions[7].id: session id "bad id": ' ' is not allowed`,
			"sessions[8].url: ", "port must be 1-65535, got 99999",
			"sessions[9].url: ", "port must be 1-65535, got 0",
		}},
		{"upstream url port", upstream.Config{URL: "http://gw:65536"}, []string{"url: ", "port must be 1-65535, got 65536"}},
		{"provider problems", upstream.Config{Provider: upstream.ProviderConfig{
			API: "ftp://u:secret@api", Protocol: "quic", Refresh: -time.Second,
		}}, []string{"provider.api: must be an http(s) URL", "provider.api_key: required", "provider.protocol:", "provider.refresh: must not be negative"}},
		{"both keys", upstream.Config{Provider: upstream.ProviderConfig{API: "https://api", APIKey: "x", APIKeyEnv: "Y"}},
			[]string{"provider.api_key: set api_key or api_key_env, not both"}},
		{"key env empty", upstream.Config{Provider: upstream.ProviderConfig{API: "https://api", APIKeyEnv: "ONCEPROXY_TEST_EMPTY_KEY"}},
			[]string{"provider.api_key_env: environment variable ONCEPROXY_TEST_EMPTY_KEY is unset or empty"}},
		{"health, retry, exhausted", upstream.Config{
			Health:        upstream.HealthConfig{URL: "/relative", Timeout: -1},
			Retry:         upstream.RetryConfig{MaxAttempts: 11, Methods: []string{"get", ""}},
			WhenExhausted: "panic",
			Fingerprint:   "chrome",
		}, []string{"health.url: must be an absolute", "health.timeout: must not be negative", "retry.max_attempts: must be 1-10",
			`retry.methods[0]: "get" is not an upper-case HTTP method`, "retry.methods[1]:", `when_exhausted: must be "fail" or "direct"`,
			`fingerprint: must be "mirror" or "go", got "chrome"`}},
		{"rules", upstream.Config{Rules: []upstream.RuleConfig{
			{Host: "*.shop.*", PathPrefix: "api", Sticky: "forever", BanStatuses: []int{99, 700}, RetryMethods: []string{"post"}, Fingerprint: "Mirror"},
		}}, []string{`rules[0].host: "*.shop.*" is not a host name`, "rules[0].path_prefix: must start with '/'", "rules[0].sticky: must be none, host, account or account_rule",
			"rules[0].ban_statuses[0]: 99", "rules[0].ban_statuses[1]: 700", "rules[0].retry_methods[0]:", `rules[0].fingerprint: must be "mirror" or "go", got "Mirror"`}},
		// A rule's name is its rate bucket for sticky: account_rule: two
		// rules of one name shared their accounts' sessions without a word.
		{"rule names", upstream.Config{Rules: []upstream.RuleConfig{
			{Name: "api", Host: "a.example"}, {Host: "b.example"}, {Name: "api", Host: "c.example"}, {Name: "rules[1]", Host: "d.example"},
		}}, []string{`rules[2].name: "api" is already used by rules[0]`, `rules[3].name: "rules[1]" is already used by rules[1]`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate(getenv)
			if err == nil {
				t.Fatalf("no error, want %v", tc.want)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error lacks %q:\n%v", w, err)
				}
			}
			if strings.Contains(err.Error(), "secret") {
				t.Errorf("error leaks a password:\n%v", err)
			}
		})
	}
}

// TestRunAndCloseLeaveNoGoroutine: Run with every loop (provider refresh,
// health checks, timed recycling), traffic through HTTP and SOCKS5
// sessions, then cancel, Close: nothing of the pool is left running.
func TestRunAndCloseLeaveNoGoroutine(t *testing.T) {
	before := goleak.IgnoreCurrent()
	defer goleak.VerifyNone(t, before)
	fp, err := fakeprovider.New(fakeprovider.Options{Sessions: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer fp.Close()
	o := newOrigin(t, true)
	defer o.Close() // before goleak looks (t.Cleanup would run after it)
	cfg := providerConfig(fp)
	cfg.CAFiles = []string{originCAFile(t, o.Server)}
	cfg.Provider.Refresh = 10 * time.Millisecond
	cfg.Health = upstream.HealthConfig{URL: o.URL, Interval: 10 * time.Millisecond, Timeout: time.Second}
	cfg.Sessions = []upstream.SessionConfig{
		{ID: "timed", URL: fp.URL("s1", "socks5"), Rotation: "timed", Interval: 50 * time.Millisecond},
		{ID: "pr", URL: fp.URL("s2", "http"), Rotation: "per_request"},
	}
	logger, _ := testLogger(t)
	p, err := upstream.New(cfg, logger)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	for i, id := range []string{"s1", "s2", "s3", "timed", "pr", "s1"} {
		r, err := send(t, p, http.MethodGet, o.URL, clientinfo.Info{Session: id}, "")
		if err != nil || r.status != 200 {
			t.Fatalf("request %d: %v %+v", i, err, r)
		}
	}
	testkit.Eventually(t, testkit.Patience, func() bool {
		return upstream.RefreshOf(p).Refreshes >= 3 && statusOf(t, p, "pr").Requests >= 3
	}, "refreshes and probes")
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run returned %v", err)
	}
	p.Close()
	// The pool's own goroutines (its loops, its connections' read and
	// write loops) must be gone now, while the provider and the origin
	// still run: ignore only theirs (server side of each connection).
	if err := goleak.Find(before,
		goleak.IgnoreAnyFunction("net/http.(*conn).serve"),
		goleak.IgnoreAnyFunction("net/http/httptest.(*Server).goServe.func1"),
		goleak.IgnoreAnyFunction("github.com/things-go/go-socks5.(*Server).Serve"),
		goleak.IgnoreAnyFunction("github.com/seed-a3c387e8/onceproxy/internal/fakeprovider.trackedPool.Submit.func1"),
		goleak.IgnoreAnyFunction("github.com/seed-a3c387e8/onceproxy/internal/fakeprovider.(*Provider).connect.func1"),
		goleak.IgnoreAnyFunction("github.com/seed-a3c387e8/onceproxy/internal/fakeprovider.pump.func1"),
		goleak.IgnoreAnyFunction("github.com/seed-a3c387e8/onceproxy/internal/fakeprovider.(*Provider).startSOCKS5.func1"),
	); err != nil {
		t.Errorf("after Run and Close, the pool left goroutines behind:\n%v", err)
	}
	fp.Close()
}

// TestRuleHostPatterns: a rule's host is a host pattern like every other
// in the configuration: "*.shop.example" covers subdomains at any depth,
// not the apex; names match whatever their case and a trailing dot.
func TestRuleHostPatterns(t *testing.T) {
	p, err := upstream.New(upstream.Config{Rules: []upstream.RuleConfig{
		{Name: "api", Host: "api.example.com"},
		{Name: "shop", Host: "*.shop.example"},
	}}, quiet)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for _, tc := range []struct{ host, want string }{
		{"api.example.com", "api"},
		{"API.Example.COM.", "api"},
		{"x.api.example.com", "default"},
		{"a.shop.example", "shop"},
		{"a.b.shop.example", "shop"},
		{"shop.example", "default"},
		{"evilshop.example", "default"},
	} {
		if got := upstream.RuleFor(p, tc.host, "/"); got != tc.want {
			t.Errorf("%s matched rule %q, want %q", tc.host, got, tc.want)
		}
	}
}

// TestProviderKeyFromGivenEnvironment: provider.api_key_env is read from
// the environment WithGetenv hands the pool (the one the program was
// given), not from the process's own: the provider API accepts the key and
// its sessions are listed.
func TestProviderKeyFromGivenEnvironment(t *testing.T) {
	const name = "PROVIDER_KEY_FOR_TEST_6d1f"
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	getenv := func(k string) string {
		if k == name {
			return fp.APIKey()
		}
		return ""
	}
	cfg := upstream.Config{Provider: upstream.ProviderConfig{API: fp.APIURL(), APIKeyEnv: name}}
	p, err := upstream.New(cfg, quiet, upstream.WithGetenv(getenv))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if n := len(p.Sessions()); n != 2 {
		t.Fatalf("%d sessions listed, want the provider's 2 (was the key sent?)", n)
	}
	if _, err := upstream.New(cfg, quiet); err == nil || !strings.Contains(err.Error(), name+" is unset") {
		t.Fatalf("without the variable in the process environment: err = %v", err)
	}
}
