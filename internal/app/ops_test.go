package app

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestRedisURLErrorHidesPassword: a redis.url that does not parse is
// reported with its password masked, as upstream.url and postgres.url are
// (it once showed in clear on stderr, in the reload's 422 body, the log).
func TestRedisURLErrorHidesPassword(t *testing.T) {
	for _, env := range [][]string{
		{"ONCEPROXY_REDIS_URL=redis://:s3cretpw@127.0.0.1:abc/0"},
		{"REDIS_URL=redis://:s3cretpw@127.0.0.1:abc/0"},
		{"ONCEPROXY_REDIS_URL=redis://:s3cret%zz@127.0.0.1:6379/0"},
	} {
		_, err := LoadConfig(shippedConfig, "", env)
		if err == nil {
			t.Fatalf("%v: accepted", env)
		}
		if strings.Contains(err.Error(), "s3cret") {
			t.Errorf("%v: the error shows the Redis password: %v", env, err)
		}
	}
}

// TestShippedPasswordEnvExample: config.yaml's own example names the
// password variable ONCEPROXY_FLEET_PASSWORD. A variable a *_env key names
// is no unknown ONCEPROXY_ variable (it was refused as one, and the
// documented example could not start).
func TestShippedPasswordEnvExample(t *testing.T) {
	path := writeConfig(t, "auth:\n  users:\n    - name: fleet\n      password_env: ONCEPROXY_FLEET_PASSWORD\n")
	if _, err := LoadConfig(shippedConfig, path, []string{"ONCEPROXY_FLEET_PASSWORD=hunter2"}); err != nil {
		t.Errorf("config.yaml's example (password_env: ONCEPROXY_FLEET_PASSWORD) refused: %v", err)
	}
	// The same for the admin token, the natural name for which is ONCEPROXY_ADMIN_TOKEN.
	if _, err := LoadConfig(shippedConfig, "", []string{"ONCEPROXY_ADMIN_TOKEN_ENV=ONCEPROXY_ADMIN_TOKEN", "ONCEPROXY_ADMIN_TOKEN=t0ken"}); err != nil {
		t.Errorf("admin.token_env naming ONCEPROXY_ADMIN_TOKEN refused: %v", err)
	}
}

// TestCheckRejectsBadListenPort: -check (LoadConfig) refuses listen
// addresses that cannot be bound (port 99999, a service name), which it
// once accepted for start-up to fail.
func TestCheckRejectsBadListenPort(t *testing.T) {
	for _, env := range []string{
		"ONCEPROXY_PROXY_LISTEN=127.0.0.1:99999",
		"ONCEPROXY_ADMIN_LISTEN=127.0.0.1:99999",
		"ONCEPROXY_SOCKS5_LISTEN=127.0.0.1:abc",
	} {
		if _, err := LoadConfig(shippedConfig, "", []string{env}); err == nil {
			t.Errorf("%s: configuration OK, but the port cannot be bound", env)
		}
	}
}

// TestHealthReportsDraining: after SIGTERM the proxy port is closed at
// once while in-flight requests drain for up to proxy.shutdown_grace, and
// /health answers 503 "shutting_down" meanwhile: it said 200 "ok", and a
// balancer kept sending clients to a port that refused them.
func TestHealthReportsDraining(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		<-release
		io.WriteString(w, "ok")
	}))
	defer origin.Close()
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()

	a := buildFromFile(t, writeConfig(t, ""), nil)
	addrs := a.Addrs()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx) }()
	defer func() { cancel(); <-done }()

	proxyURL, _ := url.Parse("http://" + addrs.Proxy)
	client := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(proxyURL)}, Timeout: 10 * time.Second}
	got := make(chan error, 1)
	go func() {
		resp, err := client.Get(origin.URL + "/slow")
		if err == nil {
			resp.Body.Close()
		}
		got <- err
	}()
	<-entered
	cancel() // SIGTERM

	// Wait until the proxy port refuses new clients.
	deadline := time.Now().Add(5 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", addrs.Proxy, 200*time.Millisecond)
		if err != nil {
			break
		}
		c.Close()
		if time.Now().After(deadline) {
			t.Fatal("proxy port still accepting after shutdown began")
		}
		time.Sleep(20 * time.Millisecond)
	}
	resp, err := http.Get("http://" + addrs.Admin + "/health")
	if err != nil {
		t.Fatalf("/health: %v", err)
	}
	var body map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&body)
	resp.Body.Close()
	if resp.StatusCode == http.StatusOK && body["status"] == "ok" {
		t.Errorf("/health answers %d %v while the proxy port refuses connections (draining)", resp.StatusCode, body)
	}
	close(release)
	if err := <-got; err != nil {
		t.Errorf("in-flight request during drain: %v", err)
	}
}

// TestEnvSecretTakenLiterally: a string key's variable is taken as it is.
// Parsed as YAML, a secret with " #" lost its tail and "~"/"null" became
// empty, silently.
func TestEnvSecretTakenLiterally(t *testing.T) {
	for _, pw := range []string{"s3cret #1", "null"} {
		cfg, err := LoadConfig(shippedConfig, "", []string{"ONCEPROXY_REDIS_ADDRS=[127.0.0.1:6379]", "ONCEPROXY_REDIS_PASSWORD=" + pw})
		if err != nil {
			t.Errorf("%q: %v", pw, err)
			continue
		}
		if cfg.Redis.Password != pw {
			t.Errorf("ONCEPROXY_REDIS_PASSWORD=%q became %q without a word", pw, cfg.Redis.Password)
		}
	}
}

// TestEnvNamesAreUnique: two keys must not map to one variable
// (envKeys is a map: a collision would silently drop one key).
func TestEnvNamesAreUnique(t *testing.T) {
	var leaves func(rt reflect.Type) int
	leaves = func(rt reflect.Type) int {
		n := 0
		for i := 0; i < rt.NumField(); i++ {
			f := rt.Field(i)
			if yamlName(f) == "" {
				continue
			}
			if isSection(f.Type) {
				n += leaves(f.Type)
			} else {
				n++
			}
		}
		return n
	}
	var cfg Config
	if want, got := leaves(reflect.TypeFor[Config]()), len(envKeys(&cfg)); want != got {
		t.Errorf("%d keys, %d variables", want, got)
	}
}

// TestEnvBoolWords: ONCEPROXY_LOG_ACCESS=no and =off pass -check;
// they must mean false (or be refused), never true.
func TestEnvBoolWords(t *testing.T) {
	for _, v := range []string{"no", "off", "false", "0"} {
		cfg, err := LoadConfig(shippedConfig, "", []string{"ONCEPROXY_LOG_ACCESS=" + v})
		if err == nil && cfg.Log.Access {
			t.Errorf("ONCEPROXY_LOG_ACCESS=%s accepted as true", v)
		}
	}
}

// TestEnvListsAndTypeErrors: a list key takes a comma-separated variable
// as NO_PROXY is written (a string list item by item, so "*.b.example"
// is no YAML alias; numbers as a YAML flow list), and a value of the wrong
// type names what the key expects rather than a Go type.
func TestEnvListsAndTypeErrors(t *testing.T) {
	cfg, err := LoadConfig(shippedConfig, "", []string{
		"ONCEPROXY_PROXY_BYPASS_HOSTS=a.example, *.b.example,",
		"ONCEPROXY_DEDUP_CACHEABLE_STATUSES=200,404",
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := cfg.Proxy.BypassHosts; !slices.Equal(got, []string{"a.example", "*.b.example"}) {
		t.Errorf("bypass_hosts from a comma-separated variable: %q", got)
	}
	if got := cfg.Dedup.CacheableStatuses; !slices.Equal(got, []int{200, 404}) {
		t.Errorf("cacheable_statuses from a comma-separated variable: %v", got)
	}
	for _, tc := range []struct{ env, want string }{
		{"ONCEPROXY_PROXY_MAX_CONNS=lots", `ONCEPROXY_PROXY_MAX_CONNS: "lots" is not a whole number`},
		{"ONCEPROXY_UPSTREAM_DIAL_TIMEOUT=5", `ONCEPROXY_UPSTREAM_DIAL_TIMEOUT: "5" is not a duration such as 45s`},
		{"ONCEPROXY_DEDUP_CACHEABLE_STATUSES=200, ok", `ONCEPROXY_DEDUP_CACHEABLE_STATUSES: "200, ok" is not a list (a, b or [a, b]), each a whole number`},
		{"ONCEPROXY_PROXY_BYPASS_HOSTS=[a.example", `ONCEPROXY_PROXY_BYPASS_HOSTS: "[a.example" is not a list (a, b or [a, b]), each a string`},
		{"ONCEPROXY_UPSTREAM_SESSIONS=gw.example:8000", `ONCEPROXY_UPSTREAM_SESSIONS: "gw.example:8000" is not a YAML list such as [{...}, {...}]`},
		{"ONCEPROXY_DEDUP_MAX_BODY_BYTES=12 potatoes", `ONCEPROXY_DEDUP_MAX_BODY_BYTES: invalid size "12 potatoes"`},
	} {
		_, err := LoadConfig(shippedConfig, "", []string{tc.env})
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Count(err.Error(), "invalid configuration") != 1 {
			t.Errorf("%s: %v\nwant one problem saying %s", tc.env, err, tc.want)
		}
	}
}
