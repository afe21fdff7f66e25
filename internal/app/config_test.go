package app

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
)

// shippedConfig is config.yaml as main embeds it.
var shippedConfig = func() []byte {
	b, err := os.ReadFile("../../config.yaml")
	if err != nil {
		panic(err)
	}
	return b
}()

func writeConfig(t testing.TB, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestShippedConfigMatchesDefaults keeps config.yaml (the documented and
// embedded defaults) and the packages' own WithDefaults in agreement.
func TestShippedConfigMatchesDefaults(t *testing.T) {
	shipped, err := LoadConfig(shippedConfig, "", nil)
	if err != nil {
		t.Fatalf("shipped config: %v", err)
	}
	var zero Config
	zero.Log = LogConfig{Level: "info", Format: "text", Access: true}
	zero.Admin = AdminConfig{Listen: "127.0.0.1:9090"}
	// Fields whose zero value is a meaningful setting get their shipped
	// value from the file alone.
	zero.SOCKS5 = socks.Config{Listen: socks.DefaultListen, AllowNoAuth: true}
	zero.Guard.AllowCIDRs = []string{"127.0.0.0/8", "::1/128"}
	zero.Dedup.Enabled = true
	zero.Dedup.TTL = dedup.DefaultTTL
	zero.Dedup.Disk.MaxBytes = dedup.DefaultDiskBytes
	zero.withDefaults()
	a, _ := yaml.Marshal(shipped)
	b, _ := yaml.Marshal(&zero)
	if string(a) != string(b) {
		t.Fatalf("config.yaml and the code defaults differ:\nconfig.yaml:\n%s\ncode:\n%s", a, b)
	}
}

func TestUnknownKeyIsNamedWithLine(t *testing.T) {
	p := writeConfig(t, "proxy:\n  listen: 127.0.0.1:8080\n  lisen: 127.0.0.1:8081\nmitm:\n  ca_dri: x\n")
	_, err := LoadConfig(shippedConfig, p, nil)
	if err == nil {
		t.Fatal("unknown keys accepted")
	}
	for _, want := range []string{`line 3: unknown key "proxy.lisen"`, `line 5: unknown key "mitm.ca_dri"`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
}

func TestValidationReportsEveryProblem(t *testing.T) {
	p := writeConfig(t, `
log: {level: loud, format: xml}
proxy: {listen: "nope", max_conns: -1, bypass_hosts: ["a/b"]}
admin: {listen: "127.0.0.1:8080"}
mitm: {leaf_validity: 1m}
upstream: {url: "ftp://x:1", dial_timeout: -1s}
`)
	_, err := LoadConfig(shippedConfig, p, nil)
	if err == nil {
		t.Fatal("bad config accepted")
	}
	for _, want := range []string{
		"log.level:", "log.format:", "proxy.listen:", "proxy.max_conns:", "proxy.bypass_hosts[0]:",
		"mitm.leaf_validity:", "upstream.url:", "upstream.dial_timeout:",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
}

func TestEnvOverrides(t *testing.T) {
	p := writeConfig(t, "proxy:\n  listen: 127.0.0.1:8080\n")
	cfg, err := LoadConfig(shippedConfig, p, []string{
		"ONCEPROXY_PROXY_LISTEN=127.0.0.1:18080",
		"ONCEPROXY_PROXY_IDLE_TIMEOUT=45s",
		"ONCEPROXY_PROXY_BYPASS_HOSTS=[a.example, \"*.b.example\"]",
		"ONCEPROXY_LOG_ACCESS=false",
		"ONCEPROXY_ADMIN_LISTEN=",
		"UNRELATED=1",
	})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Proxy.Listen != "127.0.0.1:18080" || cfg.Proxy.IdleTimeout != 45*time.Second ||
		len(cfg.Proxy.BypassHosts) != 2 || cfg.Proxy.BypassHosts[1] != "*.b.example" ||
		cfg.Log.Access || cfg.Admin.Listen != "" {
		t.Fatalf("overrides not applied: %+v", cfg)
	}

	_, err = LoadConfig(shippedConfig, p, []string{"ONCEPROXY_PROXY_LISTN=x", "ONCEPROXY_PROXY_MAX_CONNS=many"})
	if err == nil || !strings.Contains(err.Error(), "ONCEPROXY_PROXY_LISTN: unknown variable") ||
		!strings.Contains(err.Error(), "ONCEPROXY_PROXY_MAX_CONNS:") {
		t.Fatalf("bad overrides: err = %v", err)
	}
}

func TestEnvNamesCoverEveryKey(t *testing.T) {
	names := envNames(&Config{})
	for _, want := range []string{"ONCEPROXY_PROXY_LISTEN", "ONCEPROXY_MITM_CA_DIR", "ONCEPROXY_UPSTREAM_URL", "ONCEPROXY_LOG_LEVEL"} {
		found := false
		for _, n := range names {
			found = found || n == want
		}
		if !found {
			t.Errorf("%s missing from %v", want, names)
		}
	}
}

func TestEmptyConfigFileMeansDefaults(t *testing.T) {
	cfg, err := LoadConfig(shippedConfig, writeConfig(t, ""), nil)
	if err != nil || cfg.Proxy.Listen != "127.0.0.1:8080" {
		t.Fatalf("empty file: %v %+v", err, cfg)
	}
}

// TestREADMEDocumentsEveryKey keeps the README's configuration table complete.
func TestREADMEDocumentsEveryKey(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	for name, k := range envKeys(&Config{}) {
		if !strings.Contains(string(readme), "`"+k.path+"`") {
			t.Errorf("README.md does not document %s (%s)", k.path, name)
		}
	}
}

// TestCIRunsTheREADMETestCommand: CI must run exactly what the README tells
// users to run.
func TestCIRunsTheREADMETestCommand(t *testing.T) {
	const cmd = "go test -race -count=1 ./..."
	for _, f := range []string{"README.md", ".ci/run"} {
		b, err := os.ReadFile(filepath.Join("../..", f))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), cmd) {
			t.Errorf("%s does not contain %q", f, cmd)
		}
	}
}

// TestConfigExamplesAreValid uncomments the rule and session examples
// shipped in config.yaml and loads them: the examples must keep working.
func TestConfigExamplesAreValid(t *testing.T) {
	lines := strings.Split(string(shippedConfig), "\n")
	var out []string
	block := ""
	for _, l := range lines {
		switch {
		case strings.HasPrefix(l, "  # rules:"), strings.HasPrefix(l, "  # sessions:"), strings.HasPrefix(l, "  # providers:"):
			block = strings.TrimSuffix(strings.TrimPrefix(l, "  # "), ":")
			out = append(out, "  "+block+":")
		case block != "" && strings.HasPrefix(l, "  #   "):
			out = append(out, "  "+strings.TrimPrefix(l, "  # "))
		default:
			block = ""
			if l == "  rules: []" || l == "  sessions: []" || l == "  providers: []" {
				continue
			}
			out = append(out, l)
		}
	}
	cfg, err := LoadConfig(shippedConfig, writeConfig(t, strings.Join(out, "\n")), []string{"PRIMARY_API_KEY=k1", "BACKUP_API_KEY=k2"})
	if err != nil {
		t.Fatalf("uncommented examples do not load: %v", err)
	}
	if len(cfg.Upstream.Providers) != 2 || cfg.Upstream.Providers[1].Countries[1] != "de" {
		t.Fatalf("provider examples not found: %+v", cfg.Upstream.Providers)
	}
	if len(cfg.Dedup.Rules) < 5 || cfg.Dedup.Rules[0].Name != "captcha-submit" {
		t.Fatalf("dedup examples not found: %+v", cfg.Dedup.Rules)
	}
	if len(cfg.Upstream.Rules) < 2 || len(cfg.Upstream.Sessions) < 2 {
		t.Fatalf("upstream examples not found: %+v %+v", cfg.Upstream.Rules, cfg.Upstream.Sessions)
	}
}

// TestHostPatternsValidatedAtLoad: every key that takes host patterns
// speaks one dialect (exact name, or "*.domain" for any subdomain), and a
// pattern outside it is a start-up error that names its key.
func TestHostPatternsValidatedAtLoad(t *testing.T) {
	p := writeConfig(t, `
proxy: {bypass_hosts: ["*pinned.example"]}
dedup: {rules: [{name: captcha, host: "*2captcha.com"}]}
upstream: {rules: [{host: "127.0.0.*"}], insecure_skip_verify_hosts: ["a.*.example"]}
rate_limit: {exclude_hosts: ["[internal]"]}
guard: {allow_hosts: ["*"]}
`)
	_, err := LoadConfig(shippedConfig, p, nil)
	if err == nil {
		t.Fatal("glob-style host patterns accepted")
	}
	for _, want := range []string{
		`proxy.bypass_hosts[0]: "*pinned.example"`,
		`dedup.rules[0](captcha).host: "*2captcha.com"`,
		`upstream.rules[0].host: "127.0.0.*"`,
		`upstream.insecure_skip_verify_hosts[0]: "a.*.example"`,
		`rate_limit.exclude_hosts[0]: "[internal]"`,
		`guard.allow_hosts[0]:`,
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
	ok := writeConfig(t, `
proxy: {bypass_hosts: ["*.pinned.example", Pinned.Example.]}
dedup: {rules: [{host: "*.2captcha.com"}, {host: 2captcha.com}]}
upstream: {rules: [{host: "127.0.0.1"}]}
rate_limit: {exclude_hosts: ["*.internal.example"]}
`)
	if _, err := LoadConfig(shippedConfig, ok, nil); err != nil {
		t.Fatalf("host patterns rejected: %v", err)
	}
}

// TestProviderKeyFromInjectedEnvironment: upstream.provider.api_key_env is
// read from the environment the program was given, like every other
// *_env key, not from the process's own.
func TestProviderKeyFromInjectedEnvironment(t *testing.T) {
	const name = "PROVIDER_KEY_FOR_TEST_6d1f"
	if os.Getenv(name) != "" {
		t.Fatalf("%s is set in the process environment; the test needs it unset", name)
	}
	p := writeConfig(t, "upstream:\n  provider:\n    api: https://provider.example\n    api_key_env: "+name+"\n")
	if _, err := LoadConfig(shippedConfig, p, []string{name + "=k3y"}); err != nil {
		t.Fatalf("key in the injected environment not seen: %v", err)
	}
	_, err := LoadConfig(shippedConfig, p, nil)
	if err == nil || !strings.Contains(err.Error(), "upstream.provider.api_key_env: environment variable "+name+" is unset") {
		t.Fatalf("missing key: err = %v", err)
	}
}

// TestFractionForWholeNumberRefused: yaml.v3 decodes 2.9 into an int as
// 2, so upstream.retry.max_attempts: 2.9 ran with 2 and said nothing. A
// number with a fraction where a whole number goes is refused, naming its
// key (in a file) or its variable; 1e3 is 1000 and stays accepted.
func TestFractionForWholeNumberRefused(t *testing.T) {
	for _, tc := range []struct {
		doc  string
		want string
	}{
		{"upstream: {retry: {max_attempts: 2.9}}\n", "line 1: upstream.retry.max_attempts: 2.9 is not a whole number"},
		{"proxy:\n  max_conns: 1.5\n", "line 2: proxy.max_conns: 1.5 is not a whole number"},
		{"dedup: {cacheable_statuses: [200, 404.5]}\n", "line 1: dedup.cacheable_statuses[1]: 404.5 is not a whole number"},
		{"dedup: {rules: [{name: a, host: a.example, cacheable_statuses: [200.5]}]}\n", "dedup.rules[0].cacheable_statuses[0]: 200.5 is not a whole number"},
		{"mitm: {cert_cache_size: 0.5}\n", "mitm.cert_cache_size: 0.5 is not a whole number"},
	} {
		_, err := LoadConfig(shippedConfig, writeConfig(t, tc.doc), nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want %q", tc.doc, err, tc.want)
		}
	}
	_, err := LoadConfig(shippedConfig, "", []string{"ONCEPROXY_UPSTREAM_RETRY_MAX_ATTEMPTS=2.9"})
	if want := `ONCEPROXY_UPSTREAM_RETRY_MAX_ATTEMPTS: "2.9" is not a whole number`; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("env override: %v, want %q", err, want)
	}
	// Prices are fractions, and a whole number stays one, however
	// written.
	if _, err := LoadConfig(shippedConfig, writeConfig(t, "savings: {price_per_gb: 2.5}\nproxy: {max_conns: 100}\nmitm: {cert_cache_size: 1e3}\n"), nil); err != nil {
		t.Errorf("valid numbers refused: %v", err)
	}
}

// TestEnvListOfSectionsReportsWhatIsWrongInside: a variable that sets a
// list of sections (dedup.rules, upstream.sessions) with a list whose
// entry has a typo or a bad value said only that the value "is not a
// YAML list", which it is. The problem inside is reported, with the
// variable; a value that is no list at all keeps the general message.
func TestEnvListOfSectionsReportsWhatIsWrongInside(t *testing.T) {
	for _, tc := range []struct {
		env  string
		want string
	}{
		{"ONCEPROXY_DEDUP_RULES=[{name: a, host: a.example, tll: 1s}]", `ONCEPROXY_DEDUP_RULES: line 1: unknown key "dedup.rules.tll"`},
		{"ONCEPROXY_DEDUP_RULES=[{name: a, host: a.example, ttl: lots}]", `ONCEPROXY_DEDUP_RULES: line 1: [0].ttl: "lots" is not a duration such as 45s`},
		{"ONCEPROXY_UPSTREAM_SESSIONS=[{id: s1, url: 'http://127.0.0.1:1', wieght: 3}]", `ONCEPROXY_UPSTREAM_SESSIONS: line 1: unknown key "upstream.sessions.wieght"`},
		{"ONCEPROXY_DEDUP_RULES=lots", `ONCEPROXY_DEDUP_RULES: "lots" is not a YAML list such as [{...}, {...}]`},
	} {
		_, err := LoadConfig(shippedConfig, "", []string{tc.env})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want %q", tc.env, err, tc.want)
		}
	}
}

// TestEnvEmptyClearsList: an empty variable clears its key, and a list
// cleared is empty. It used to become nil, which the sections read as
// "unset" and filled with their default list: ONCEPROXY_SOCKS5_MITM_PORTS=
// kept [80, 443, 8080, 8443] (config.yaml: [] = dial every port first) and
// ONCEPROXY_UPSTREAM_RETRY_METHODS= kept retrying GET and HEAD.
func TestEnvEmptyClearsList(t *testing.T) {
	cfg, err := LoadConfig(shippedConfig, "", []string{
		"ONCEPROXY_SOCKS5_MITM_PORTS=", "ONCEPROXY_UPSTREAM_RETRY_METHODS=", "ONCEPROXY_DEDUP_KEY_HEADERS=",
		"ONCEPROXY_DEDUP_IGNORE_PARAMS=", "ONCEPROXY_GUARD_ALLOW_CIDRS=",
	})
	if err != nil {
		t.Fatal(err)
	}
	for key, n := range map[string]int{
		"socks5.mitm_ports": len(cfg.SOCKS5.MITMPorts), "upstream.retry.methods": len(cfg.Upstream.Retry.Methods),
		"dedup.key_headers": len(cfg.Dedup.KeyHeaders), "dedup.ignore_params": len(cfg.Dedup.IgnoreParams),
		"guard.allow_cidrs": len(cfg.Guard.AllowCIDRs),
	} {
		if n != 0 {
			t.Errorf("%s has %d entries after its variable was set empty, want none", key, n)
		}
	}
}

// TestCollectionForValueNamesItsKey: a list or a mapping where one value
// goes (listen: [a]) came back as yaml's "line 1: cannot unmarshal !!seq
// into string", which names no key; in a flow mapping or a long section
// the line alone does not say which. The key is named, as it is for a
// scalar of the wrong type.
func TestCollectionForValueNamesItsKey(t *testing.T) {
	for _, tc := range []struct{ doc, want string }{
		{"proxy: {listen: [a]}\n", "line 1: proxy.listen: a list is not a string"},
		{"proxy:\n  max_conns: {a: 1}\n", "line 2: proxy.max_conns: a mapping is not a whole number"},
		{"dedup: {ttl: [1s]}\n", "line 1: dedup.ttl: a list is not a duration such as 45s"},
		{"dedup: {rules: {name: a}}\n", "line 1: dedup.rules: a mapping is not []dedup.RuleConfig"},
		{"upstream:\n  rules:\n    - name: a\n      ban_statuses: {x: 1}\n", "line 4: upstream.rules[0].ban_statuses: a mapping is not []int"},
		{"socks5: {mitm_ports: [443, [8443]]}\n", "line 1: socks5.mitm_ports[1]: a list is not a whole number"},
	} {
		_, err := LoadConfig(shippedConfig, writeConfig(t, tc.doc), nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want %q", tc.doc, err, tc.want)
		}
	}
}

// TestLowerMaxFlightsAlone: dedup.max_flights_per_client defaults to a
// quarter of max_flights, but config.yaml wrote the quarter of the shipped
// 4096 out (1024), so max_flights: 100 alone refused to start, over a key
// the file never set. The per-client cap follows max_flights unless set.
func TestLowerMaxFlightsAlone(t *testing.T) {
	cfg, err := LoadConfig(shippedConfig, writeConfig(t, "dedup: {max_flights: 100}\n"), nil)
	if err != nil {
		t.Fatalf("max_flights: 100 alone: %v", err)
	}
	if got := cfg.Dedup.MaxFlightsPerClient; got != 25 {
		t.Errorf("max_flights_per_client = %d, want a quarter of max_flights, 25", got)
	}
	shipped, err := LoadConfig(shippedConfig, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := shipped.Dedup.MaxFlightsPerClient; got != 1024 {
		t.Errorf("as shipped: max_flights_per_client %d, want 1024", got)
	}
}

// TestLowerMaxIdleConnsAlone: upstream.max_idle_conns_per_host defaults to
// 512 or max_idle_conns when that is lower, but config.yaml wrote 512 out,
// so max_idle_conns: 100 alone refused to start over a key the file never
// set.
func TestLowerMaxIdleConnsAlone(t *testing.T) {
	cfg, err := LoadConfig(shippedConfig, writeConfig(t, "upstream: {max_idle_conns: 100}\n"), nil)
	if err != nil {
		t.Fatalf("max_idle_conns: 100 alone: %v", err)
	}
	if got := cfg.Upstream.MaxIdleConnsPerHost; got != 100 {
		t.Errorf("max_idle_conns_per_host = %d, want max_idle_conns, 100", got)
	}
	shipped, err := LoadConfig(shippedConfig, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := shipped.Upstream.MaxIdleConnsPerHost; got != 512 {
		t.Errorf("as shipped: max_idle_conns_per_host %d, want 512", got)
	}
}

// TestExplicitZeroRefused: a number written 0 where config.yaml gives no
// meaning to 0 was taken for "unset" and replaced by the default, so
// proxy.idle_timeout: 0s (no timeout, as net/http reads it) ran with 2m
// and auth.max_failures_per_minute: 0 with 30. It is refused, naming the
// key and its default. The keys whose 0 config.yaml explains keep it, and
// an empty variable still clears a key back to its default.
func TestExplicitZeroRefused(t *testing.T) {
	for _, tc := range []struct{ doc, want string }{
		{"proxy: {idle_timeout: 0s}\n", "proxy.idle_timeout: 0 has no meaning here; remove the key for its default (2m0s)"},
		{"auth: {max_failures_per_minute: 0}\n", "auth.max_failures_per_minute: 0 has no meaning here; remove the key for its default (30)"},
		{"dedup: {max_body_bytes: 0}\n", "dedup.max_body_bytes: 0 has no meaning here; remove the key for its default (8MiB)"},
		{"upstream: {retry: {max_attempts: 0}}\n", "upstream.retry.max_attempts: 0 has no meaning here"},
	} {
		_, err := LoadConfig(shippedConfig, writeConfig(t, tc.doc), nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want %q", tc.doc, err, tc.want)
		}
	}
	_, err := LoadConfig(shippedConfig, "", []string{"ONCEPROXY_DEDUP_FLIGHT_TIMEOUT=0s"})
	if want := "dedup.flight_timeout: 0 has no meaning here"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("ONCEPROXY_DEDUP_FLIGHT_TIMEOUT=0s: %v, want %q", err, want)
	}
	cfg, err := LoadConfig(shippedConfig, writeConfig(t, "dedup: {ttl: 0s, disk: {max_bytes: 0}}\nproxy: {max_conns_per_client: 0}\n"),
		[]string{"ONCEPROXY_PROXY_IDLE_TIMEOUT="})
	if err != nil {
		t.Fatalf("zeros config.yaml explains, and an empty variable: %v", err)
	}
	if cfg.Dedup.TTL != 0 || cfg.Dedup.Disk.MaxBytes != 0 || cfg.Proxy.IdleTimeout != 2*time.Minute {
		t.Errorf("ttl %s, disk.max_bytes %s, idle_timeout %s; want 0s, 0B and the default 2m", cfg.Dedup.TTL, cfg.Dedup.Disk.MaxBytes, cfg.Proxy.IdleTimeout)
	}
}

// TestTimeoutsThatAddUpAreBounded: deadlines are sums of configured
// durations (postgres: dial_timeout + timeout, and 3 × dial_timeout + 7 ×
// timeout for a lease's end; redis: dial_timeout + timeout; a fleet
// waiter: flight_timeout + 5s; a rotation's claim: a provider's timeout
// + 5s). A value near time.Duration's end (2562047h) was accepted and
// wrapped the sum round below zero. Each input is bounded at load, named
// by its key.
func TestTimeoutsThatAddUpAreBounded(t *testing.T) {
	for _, tc := range []struct{ doc, want string }{
		{"postgres: {dial_timeout: 2562000h}\n", "postgres.dial_timeout: must be at most 24h0m0s"},
		{"postgres: {dial_timeout: 900000h}\n", "postgres.dial_timeout: must be at most 24h0m0s"},
		{"redis: {dial_timeout: 2562000h}\n", "redis.dial_timeout: must be at most 24h0m0s"},
		{"redis: {timeout: 2562000h, lease: 2562047h, presence_ttl: 2562047h}\n", "redis.timeout: must be at most 24h0m0s"},
		{"dedup: {flight_timeout: 2562047h}\n", "dedup.flight_timeout: must be at most 24h0m0s"},
		{"upstream: {provider: {api: 'https://api.example', api_key: k, timeout: 2562047h}}\n", "upstream.provider.timeout: must be at most 24h0m0s"},
		{"upstream: {providers: [{name: a, api: 'https://api.example', api_key: k, timeout: 2562047h}]}\n", "upstream.providers[0].timeout: must be at most 24h0m0s"},
	} {
		_, err := LoadConfig(shippedConfig, writeConfig(t, tc.doc), nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want %q", tc.doc, err, tc.want)
		}
	}
	// The bound itself is a valid value.
	if _, err := LoadConfig(shippedConfig, writeConfig(t, "postgres: {dial_timeout: 24h}\nredis: {dial_timeout: 24h, timeout: 24h, lease: 72h, presence_ttl: 72h}\n"+
		"dedup: {flight_timeout: 24h}\nupstream: {provider: {api: 'https://api.example', api_key: k, timeout: 24h}}\n"), nil); err != nil {
		t.Errorf("timeouts at the bound refused: %v", err)
	}
}

// TestRedisURLErrorReadsAsWritten: a redis.url that does not parse as
// Redis's was quoted escaped again (a database "my db" came out my%20db,
// a name in Cyrillic as %XX), so the operator could not find what they
// wrote. It reads as written, the user name and password masked.
func TestRedisURLErrorReadsAsWritten(t *testing.T) {
	for _, env := range []string{"REDIS_URL", "ONCEPROXY_REDIS_URL"} {
		_, err := LoadConfig(shippedConfig, "", []string{env + "=redis://:s3cret@127.0.0.1:6379/my db"})
		want := `redis.url: redis://:xxxxx@127.0.0.1:6379/my db: redis: invalid database number: "my db"`
		if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "s3cret") {
			t.Errorf("%s: error %v, want %q and no password", env, err, want)
		}
	}
	_, err := LoadConfig(shippedConfig, writeConfig(t, "redis: {url: 'redis://u:p@ss@127.0.0.1:6379/кэш'}\n"), nil)
	if want := `redis.url: redis://xxxxx:xxxxx@127.0.0.1:6379/кэш: redis: invalid database number: "кэш"`; err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "p@ss") {
		t.Errorf("file: error %v, want %q and no password", err, want)
	}
}

// TestEveryProblemInOneGo: unknown keys and values of the wrong type
// stopped loading before any other check ran, and a byte size yaml
// refused stopped decoding too, so that a file with several mistakes
// took a round of fixes each. Every problem comes at once: the file's
// unknown keys and refused values in line order (those after a refused
// byte size included), the variables' next, then the checks of what was
// read. A key whose value was refused is not checked again (2.9 decodes
// as 2, 0.5 as 0, which has no meaning here).
func TestEveryProblemInOneGo(t *testing.T) {
	p := writeConfig(t, `proxy:
  lisen: 127.0.0.1:8081
  max_conns: many
  listen: nope
  idle_timeout: 0s
dedup:
  max_body_bytes: 1XB
  max_flights: 0
  spool_memory_bytes: lots
upstream:
  retry: {max_attempts: 0.5}
  dial_timout: 1s
  dial_timeout: -1s
log: {level: loud}
`)
	_, err := LoadConfig(shippedConfig, p, []string{"ONCEPROXY_MITM_CERT_CACHE_SIZE=several"})
	if err == nil {
		t.Fatal("a file with eleven problems loaded")
	}
	msg := err.Error()
	want := []string{
		"config " + p + ": invalid configuration:",
		`line 2: unknown key "proxy.lisen"`,
		`line 3: proxy.max_conns: "many" is not a whole number`,
		"line 7: dedup.max_body_bytes:",
		"line 9: dedup.spool_memory_bytes:",
		"line 11: upstream.retry.max_attempts: 0.5 is not a whole number",
		`line 12: unknown key "upstream.dial_timout"`,
		`ONCEPROXY_MITM_CERT_CACHE_SIZE: "several" is not a whole number`,
		"dedup.max_flights: 0 has no meaning here",
		"proxy.idle_timeout: 0 has no meaning here",
		"log.level: must be debug, info, warn or error",
		"proxy.listen:",
		"upstream.dial_timeout: must not be negative",
	}
	at := -1
	for _, w := range want {
		i := strings.Index(msg, w)
		if i < 0 {
			t.Errorf("error lacks %q:\n%s", w, msg)
			continue
		}
		if i < at {
			t.Errorf("%q out of order:\n%s", w, msg)
		}
		at = i
	}
	for _, never := range []string{"upstream.retry.max_attempts: 0 has no meaning", "mitm.cert_cache_size:", "proxy.max_conns: must"} {
		if strings.Contains(msg, never) {
			t.Errorf("a refused value checked again (%q):\n%s", never, msg)
		}
	}
	// Quoted sizes are written over whole, and what follows them read.
	_, err = LoadConfig(shippedConfig, writeConfig(t, "dedup: {max_body_bytes: \"1 XB\", spool_memory_bytes: 'l''ots', tll: 1s}\nlog: {level: loud}\n"), nil)
	for _, w := range []string{`line 1: dedup.max_body_bytes: invalid size "1 XB"`, `line 1: dedup.spool_memory_bytes: invalid size "l'ots"`,
		`line 1: unknown key "dedup.tll"`, "log.level: must be"} {
		if err == nil || !strings.Contains(err.Error(), w) {
			t.Errorf("quoted sizes: error %v lacks %q", err, w)
		}
	}
	// One problem reads as it always did.
	_, err = LoadConfig(shippedConfig, writeConfig(t, "proxy:\n  lisen: x\n"), nil)
	if want := "line 2: unknown key \"proxy.lisen\""; err == nil || !strings.HasSuffix(err.Error(), ": invalid configuration:\n  "+want) {
		t.Errorf("one unknown key: %v, want only %q", err, want)
	}
}

// TestExplicitZeroInListEntriesRefused: the rule of TestExplicitZeroRefused
// covered the top-level keys only. A session's weight: 0 ran with 5 and a
// provider's refresh: 0s with 5m, said nowhere; inside list entries, in
// the file or a variable's list, such a 0 is refused too, naming the full
// key path. A 0 the entry keeps (a provider's priority) stays allowed.
func TestExplicitZeroInListEntriesRefused(t *testing.T) {
	p := writeConfig(t, `upstream:
  sessions:
    - {id: s1, url: 'http://127.0.0.1:1'}
    - {id: s2, url: 'http://127.0.0.1:2', weight: 0}
  providers:
    - {name: a, api: 'https://a.example', api_key: k, priority: 0, refresh: 0s}
    - {name: b, api: 'https://b.example', api_key: k, timeout: 0s, max_sessions: 0}
`)
	_, err := LoadConfig(shippedConfig, p, nil)
	for _, want := range []string{
		"upstream.sessions[1].weight: 0 has no meaning here; remove the key for its default (5)",
		"upstream.providers[0].refresh: 0 has no meaning here; remove the key for its default (5m0s)",
		"upstream.providers[1].timeout: 0 has no meaning here; remove the key for its default (10s)",
		"upstream.providers[1].max_sessions: 0 has no meaning here; remove the key for its default (1000)",
	} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v lacks %q", err, want)
		}
	}
	if err != nil && strings.Contains(err.Error(), "priority") {
		t.Errorf("a provider's priority 0, which it keeps, refused: %v", err)
	}
	// A variable's list is read as the file's is, and wins over it.
	_, err = LoadConfig(shippedConfig, p, []string{"ONCEPROXY_UPSTREAM_SESSIONS=[{id: s3, url: 'http://127.0.0.1:3', weight: 0}, {id: s4, url: 'http://127.0.0.1:4'}]"})
	if want := "upstream.sessions[0].weight: 0 has no meaning here"; err == nil || !strings.Contains(err.Error(), want) ||
		strings.Contains(err.Error(), "upstream.sessions[1].weight") {
		t.Errorf("variable's list: error %v, want %q alone for sessions", err, want)
	}
	// A dedup rule's ttl: 0s means coalesce only, and stays.
	cfg, err := LoadConfig(shippedConfig, writeConfig(t, "upstream:\n  sessions: [{id: s1, url: 'http://127.0.0.1:1', weight: 3}]\n"+
		"  providers: [{name: a, api: 'https://a.example', api_key: k, priority: 0}]\ndedup: {rules: [{name: live, host: a.example, ttl: 0s}]}\n"), nil)
	if err != nil {
		t.Fatalf("entries without a meaningless 0: %v", err)
	}
	if cfg.Upstream.Sessions[0].Weight != 3 || cfg.Upstream.Providers[0].Refresh != 5*time.Minute || *cfg.Dedup.Rules[0].TTL != 0 {
		t.Errorf("weight %d, refresh %s, rule ttl %s; want 3, the default 5m and 0s", cfg.Upstream.Sessions[0].Weight, cfg.Upstream.Providers[0].Refresh, *cfg.Dedup.Rules[0].TTL)
	}
}
