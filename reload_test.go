package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestReload: a reload (POST /config/reload) applies a new password and a
// new rate limit while requests keep flowing: none of them fails, a
// request in flight across the reload finishes, the new values are in
// force at once. A change that needs a restart (a listener) is reported
// and not applied; a broken file is refused whole, every problem listed,
// and the running configuration stays.
func TestReload(t *testing.T) {
	release := make(chan struct{})
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			<-release
		}
		io.WriteString(w, "page")
	}))
	defer origin.Close()
	const base = "log: {level: info}\nauth: {users: [{name: alice, password_env: PW_OLD}]}\n" +
		"dedup: {rules: [{name: short, path_prefix: /ttl, ttl: 100ms}]}\n"
	cfgFile := writeConfig(t, base)
	env := append(testEnv(t, httptest.NewTLSServer(nil)), "PW_OLD=old-secret", "PW_NEW=new-secret")
	ready := make(chan [2]string, 1)
	done := make(chan error, 1)
	stop := make(chan struct{})
	go func() {
		ctx, cancel := contextUntil(stop)
		defer cancel()
		done <- run(ctx, []string{"-config", cfgFile}, env, io.Discard, func(p, a string) { ready <- [2]string{p, a} })
	}()
	addrs := <-ready
	defer func() {
		close(stop)
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	}()
	proxyAddr, admin := addrs[0], addrs[1]
	reload := func() (int, map[string]any) {
		t.Helper()
		resp, err := http.Post("http://"+admin+"/config/reload", "", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var body map[string]any
		json.NewDecoder(resp.Body).Decode(&body)
		return resp.StatusCode, body
	}

	// Steady load with whichever password is in force, and one request
	// in flight across the reloads.
	var pw atomic.Value
	pw.Store("old-secret")
	var reloading atomic.Bool // the password is being replaced
	var failed, served atomic.Int64
	var wg sync.WaitGroup
	stopLoad := make(chan struct{})
	for range 4 {
		wg.Go(func() {
			// One client per password, keeping its connections as a
			// scraper's would: a new client per request leaves an idle
			// connection behind each time, and past
			// proxy.max_conns_per_client (2,048) the proxy answers 429.
			clients := map[string]*http.Client{}
			for {
				select {
				case <-stopLoad:
					return
				default:
				}
				p := pw.Load().(string)
				c := clients[p]
				if c == nil {
					c = plainClient(proxyAddr, "alice", p)
					clients[p] = c
				}
				code, _ := status(t, c, origin.URL+"/page")
				switch {
				case code == 200:
					served.Add(1)
				case code == 407 && (reloading.Load() || pw.Load().(string) != p):
					// Sent with the password being replaced.
				default:
					failed.Add(1)
				}
			}
		})
	}
	inflight := make(chan int, 1)
	go func() {
		code, _ := status(t, plainClient(proxyAddr, "alice", "old-secret"), origin.URL+"/slow")
		inflight <- code
	}()
	time.Sleep(200 * time.Millisecond)

	// A new password and a rate limit.
	reloading.Store(true)
	if err := os.WriteFile(cfgFile, []byte(strings.NewReplacer("PW_OLD", "PW_NEW", "ttl: 100ms", "ttl: 1h").Replace(base)+
		"rate_limit: {requests: 100000, window: 1m}\nproxy: {max_conns: 100}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	code, body := reload()
	pw.Store("new-secret")
	reloading.Store(false)
	if code != 200 {
		t.Fatalf("reload: %d %v", code, body)
	}
	changed, _ := json.Marshal(body["changed"])
	restart, _ := json.Marshal(body["restart_needed"])
	if !strings.Contains(string(changed), "auth.users") || !strings.Contains(string(changed), "rate_limit.requests") ||
		!strings.Contains(string(changed), "dedup.rules") ||
		!strings.Contains(string(restart), "proxy.max_conns") {
		t.Errorf("reload said changed %s, restart needed %s", changed, restart)
	}
	if c, _ := status(t, plainClient(proxyAddr, "alice", "old-secret"), origin.URL+"/page"); c != 407 {
		t.Errorf("the old password after the reload: %d, want 407", c)
	}
	if c, _ := status(t, plainClient(proxyAddr, "alice", "new-secret"), origin.URL+"/page"); c != 200 {
		t.Errorf("the new password after the reload: %d, want 200", c)
	}
	// The rule's new TTL: a page is still cached well past the old 100ms.
	alice := plainClient(proxyAddr, "alice", "new-secret")
	if _, xc := status(t, alice, origin.URL+"/ttl/a"); !strings.HasPrefix(xc, "MISS") {
		t.Fatalf("first fetch under the rule: %q", xc)
	}
	time.Sleep(300 * time.Millisecond)
	if _, xc := status(t, alice, origin.URL+"/ttl/a"); !strings.HasPrefix(xc, "HIT") {
		t.Errorf("300ms later: %q, want a HIT (the reloaded rule's ttl is 1h, not 100ms)", xc)
	}

	// A broken file is refused whole: the running configuration stays.
	// Every problem is listed at once, a value of the wrong type, an
	// unknown key or a byte size that does not parse with the rest.
	for _, broken := range []struct {
		text string
		want []string
	}{
		{"proxy: {max_conns: -3}\nrate_limit: {window: -1s}\nauth: {users: [{name: alice, password_env: PW_NEW}]}\n",
			[]string{"proxy.max_conns", "rate_limit.window"}},
		{"rate_limit: {window: nope}\nlog: {level: loud}\ndedup: {max_body_bytes: lots, rules: [{name: r}, {name: r}]}\nguard: {allow_hostz: []}\n",
			[]string{"line 1: rate_limit.window", "nope", "line 3: dedup.max_body_bytes", `unknown key \"guard.allow_hostz\"`,
				"log.level", "dedup.rules[1](r).name"}},
	} {
		if err := os.WriteFile(cfgFile, []byte(broken.text), 0o644); err != nil {
			t.Fatal(err)
		}
		code, body = reload()
		problems, _ := json.Marshal(body["problems"])
		if code != http.StatusUnprocessableEntity {
			t.Errorf("a broken file: %d %v, want 422", code, body)
		}
		for _, w := range broken.want {
			if !strings.Contains(string(problems), w) {
				t.Errorf("a broken file: problems %s lack %s", problems, w)
			}
		}
	}
	if c, _ := status(t, plainClient(proxyAddr, "alice", "new-secret"), origin.URL+"/page"); c != 200 {
		t.Errorf("after a refused reload: %d, want 200 (the running configuration stays)", c)
	}

	close(release)
	if c := <-inflight; c != 200 {
		t.Errorf("the request in flight across the reloads: %d, want 200", c)
	}
	close(stopLoad)
	wg.Wait()
	t.Logf("%d requests served during the reloads, %d failed", served.Load(), failed.Load())
	if failed.Load() != 0 {
		t.Errorf("%d requests failed during the reloads", failed.Load())
	}
}

// contextUntil is a context that ends when stop is closed.
func contextUntil(stop <-chan struct{}) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		select {
		case <-stop:
		case <-ctx.Done():
		}
		cancel()
	}()
	return ctx, cancel
}

// TestSIGHUPReloads: the program reloads its configuration file on
// SIGHUP.
func TestSIGHUPReloads(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "page") }))
	defer origin.Close()
	p := startBinary(t, "auth: {users: [{name: alice, password_env: PW_OLD}]}\n", append(testEnv(t, httptest.NewTLSServer(nil)),
		"PW_OLD=old-secret", "PW_NEW=new-secret"))
	if c, _ := status(t, plainClient(p.proxyAddr, "alice", "old-secret"), origin.URL+"/"); c != 200 {
		t.Fatalf("before: %d", c)
	}
	if err := os.WriteFile(p.config, []byte("auth: {users: [{name: alice, password_env: PW_NEW}]}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, testkit.Patience, func() bool {
		c, _ := status(t, plainClient(p.proxyAddr, "alice", "new-secret"), origin.URL+"/")
		return c == 200
	}, "the new password to work after SIGHUP")
	if c, _ := status(t, plainClient(p.proxyAddr, "alice", "old-secret"), origin.URL+"/"); c != 407 {
		t.Errorf("the old password after SIGHUP: %d, want 407", c)
	}
}

// TestReloadUpstream: a reload switches the upstream from one provider to
// two with priorities while a request is in flight through the first:
// that request finishes, the next ones go through the new primary, and
// the keys that shape connections (dial_timeout) are reported as needing a
// restart and keep their running value.
func TestReloadUpstream(t *testing.T) {
	release := make(chan struct{})
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			<-release
		}
		io.WriteString(w, "page")
	}))
	defer origin.Close()
	a := fakeprovider.Start(t, fakeprovider.Options{Sessions: 1, ExitIPs: [2]byte{2, 9}})
	b := fakeprovider.Start(t, fakeprovider.Options{Sessions: 1, ExitIPs: [2]byte{10, 19}})
	one := fmt.Sprintf("log: {level: info}\nupstream:\n  provider: {api: %q, api_key: %q}\n", a.APIURL(), a.APIKey())
	two := fmt.Sprintf("log: {level: info}\nupstream:\n  dial_timeout: 3s\n  providers:\n"+
		"    - {name: new, api: %q, api_key: %q, priority: 10}\n    - {name: old, api: %q, api_key: %q}\n",
		b.APIURL(), b.APIKey(), a.APIURL(), a.APIKey())
	cfgFile := writeConfig(t, one)
	env := testEnv(t, httptest.NewTLSServer(nil))
	ready := make(chan [2]string, 1)
	done := make(chan error, 1)
	stop := make(chan struct{})
	go func() {
		ctx, cancel := contextUntil(stop)
		defer cancel()
		done <- run(ctx, []string{"-config", cfgFile}, env, io.Discard, func(p, a string) { ready <- [2]string{p, a} })
	}()
	addrs := <-ready
	defer func() {
		close(stop)
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	}()
	proxyAddr, admin := addrs[0], addrs[1]
	via := func(path string) (int, string) {
		resp, err := plainClient(proxyAddr, "", "").Get(origin.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, resp.Header.Get("X-Onceproxy-Upstream")
	}
	if code, up := via("/before"); code != 200 || up != "s1" {
		t.Fatalf("before the reload: %d via %q", code, up)
	}
	inflight := make(chan string, 1)
	go func() { _, up := via("/slow"); inflight <- up }()
	time.Sleep(200 * time.Millisecond)

	if err := os.WriteFile(cfgFile, []byte(two), 0o644); err != nil {
		t.Fatal(err)
	}
	resp, err := http.Post("http://"+admin+"/config/reload", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	var body map[string]any
	json.NewDecoder(resp.Body).Decode(&body)
	resp.Body.Close()
	changed, _ := json.Marshal(body["changed"])
	restart, _ := json.Marshal(body["restart_needed"])
	if resp.StatusCode != 200 || !strings.Contains(string(changed), "upstream.providers") ||
		!strings.Contains(string(restart), "upstream.dial_timeout") || strings.Contains(string(changed), "dial_timeout") {
		t.Fatalf("reload: %d, changed %s, restart needed %s", resp.StatusCode, changed, restart)
	}
	if code, up := via("/after"); code != 200 || up != "new.s1" {
		t.Fatalf("after the reload: %d via %q, want the new primary", code, up)
	}
	close(release)
	if up := <-inflight; up != "s1" {
		t.Fatalf("the request in flight across the reload answered via %q", up)
	}
	var st struct {
		Providers []struct {
			Name     string `json:"name"`
			Priority int    `json:"priority"`
		} `json:"providers"`
	}
	if err := testkit.GetJSON("http://"+admin+"/upstream/sessions", &st); err != nil {
		t.Fatal(err)
	}
	if len(st.Providers) < 2 || st.Providers[0].Name != "new" || st.Providers[0].Priority != 10 {
		t.Fatalf("providers after the reload: %+v", st.Providers)
	}
}
