package app

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestBadValueNamesItsKey: a value read by a text unmarshaller (byte
// sizes, process.memory_limit, process.gc_percent) that does not parse is
// reported with its line and key path, like any other bad value. It used to
// come back as the parser's bare message ("invalid size \"lots\"") with
// nothing to say which of the twenty size keys held it.
func TestBadValueNamesItsKey(t *testing.T) {
	for _, tc := range []struct{ text, want string }{
		{"dedup:\n  max_body_bytes: lots\n", `line 2: dedup.max_body_bytes: invalid size "lots"`},
		{"dedup:\n  disk:\n    max_bytes: -1\n", `line 3: dedup.disk.max_bytes: invalid size "-1"`},
		{"redis: {max_value_bytes: 2 megs}\n", `line 1: redis.max_value_bytes: invalid size "2 megs"`},
		{"process:\n  memory_limit: lots\n", "line 2: process.memory_limit: want auto, off or a size"},
		{"process:\n  gc_percent: 5\n", "line 2: process.gc_percent: want auto or a number from 25 to 10000"},
	} {
		_, err := LoadConfig(shippedConfig, writeConfig(t, tc.text), nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want it to contain %q", tc.text, err, tc.want)
		}
		if err != nil && strings.Count(err.Error(), "process.") > 1 {
			t.Errorf("%q: the key is named twice: %v", tc.text, err)
		}
	}
	// Every such problem at once.
	_, err := LoadConfig(shippedConfig, writeConfig(t, "dedup: {max_body_bytes: lots, spool_memory_bytes: many}\nprocess: {memory_limit: much}\n"), nil)
	for _, want := range []string{"line 1: dedup.max_body_bytes:", "line 1: dedup.spool_memory_bytes:", "line 2: process.memory_limit:"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v lacks %q", err, want)
		}
	}
	// An environment override keeps naming its variable.
	_, err = LoadConfig(shippedConfig, "", []string{"ONCEPROXY_DEDUP_MAX_BODY_BYTES=lots"})
	if err == nil || !strings.Contains(err.Error(), `ONCEPROXY_DEDUP_MAX_BODY_BYTES: invalid size "lots"`) {
		t.Errorf("env override: %v", err)
	}
}

// buildFromFile builds an App from the shipped defaults plus the file at
// path, with loopback listeners on free ports, reloading from the same
// file.
func buildFromFile(t testing.TB, path string, env []string) *App {
	t.Helper()
	env = append([]string{
		"ONCEPROXY_PROXY_LISTEN=127.0.0.1:0", "ONCEPROXY_SOCKS5_LISTEN=", "ONCEPROXY_ADMIN_LISTEN=127.0.0.1:0",
		"ONCEPROXY_MITM_CA_DIR=" + t.TempDir(), "ONCEPROXY_DEDUP_DISK_DIR=" + t.TempDir(), "ONCEPROXY_DEDUP_SPOOL_DIR=" + t.TempDir(),
	}, env...)
	load := func() (*Config, error) { return LoadConfig(shippedConfig, path, env) }
	cfg, err := load()
	if err != nil {
		t.Fatal(err)
	}
	a, err := Build(cfg, Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Getenv: func(k string) string { return LookupEnv(env, k) }, Load: load})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	return a
}

// TestReloadKeepsReportingRestartKeys: an upstream key that needs a
// restart (upstream.dial_timeout) keeps its running value, so every
// reload reports it until the process restarts, as it does for every
// other such key (proxy.max_conns). It used to be reported once: the
// first reload recorded the new value as running.
func TestReloadKeepsReportingRestartKeys(t *testing.T) {
	path := writeConfig(t, "log: {level: info}\n")
	a := buildFromFile(t, path, nil)
	if err := os.WriteFile(path, []byte("upstream: {dial_timeout: 3s}\nproxy: {max_conns: 100}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		res, err := a.Reload()
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{"upstream.dial_timeout", "proxy.max_conns"} {
			if !slices.Contains(res.Restart, k) || slices.Contains(res.Changed, k) {
				t.Errorf("reload %d: changed %v, restart needed %v; want %s needing a restart", i+1, res.Changed, res.Restart, k)
			}
		}
	}
}

// TestReloadSavingsPrices: what a reload reports as applied is in force.
// The savings prices reached the dedup engine only through the upstream
// pool, which keeps the prices it was built with, yet a reload reported
// them as changed.
func TestReloadSavingsPrices(t *testing.T) {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "page") }))
	defer origin.Close()
	path := writeConfig(t, "log: {level: info}\n")
	a := buildFromFile(t, path, nil)
	if err := os.WriteFile(path, []byte("savings: {price_per_1000_requests: 1000}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	res, err := a.Reload()
	if err != nil {
		t.Fatal(err)
	}
	for range 2 { // a MISS, then a HIT that saves one request
		req, _ := http.NewRequest(http.MethodGet, origin.URL+"/p", nil)
		resp, err := a.Engine.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	saved := a.Engine.Stats().MoneySaved
	const key = "savings.price_per_1000_requests"
	switch {
	case slices.Contains(res.Changed, key) && saved != 1:
		t.Errorf("reload reported %s as applied, but one avoided request saved %v, want 1", key, saved)
	case !slices.Contains(res.Changed, key) && !slices.Contains(res.Restart, key):
		t.Errorf("reload reported %s neither applied nor needing a restart: changed %v, restart %v", key, res.Changed, res.Restart)
	}
}

// TestAdminServerDeadlines: an admin client that sends its headers and
// then stalls in its body is answered and cut off, instead of holding a
// connection and a goroutine for ever; writes are bounded too.
func TestAdminServerDeadlines(t *testing.T) {
	a := buildFromFile(t, writeConfig(t, ""), nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx) }()
	defer func() { cancel(); <-done }()

	if a.admin.WriteTimeout <= 0 {
		t.Errorf("admin server without a write timeout")
	}
	c, err := net.Dial("tcp", a.Addrs().Admin)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	io.WriteString(c, "POST /cache/invalidate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{\"url\":")
	// Well past the server's own bound: the test waits for the server,
	// it does not time it.
	c.SetReadDeadline(time.Now().Add(time.Minute))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("a stalled body was neither answered nor cut: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Errorf("stalled body: %d, want 400", resp.StatusCode)
	}
}

// TestReloadRefusalIsLogged: a refused reload says so in the log, once,
// with the reason: a SIGHUP has nobody else to tell.
func TestReloadRefusalIsLogged(t *testing.T) {
	path := writeConfig(t, "log: {level: info}\n")
	a := buildFromFile(t, path, nil)
	var logs bytes.Buffer
	a.log = slog.New(slog.NewTextHandler(&logs, nil))
	if err := os.WriteFile(path, []byte("dedup: {ttl: -1s}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Reload(); err == nil {
		t.Fatal("a negative dedup.ttl was applied")
	}
	if n := strings.Count(logs.String(), "configuration reload refused"); n != 1 || !strings.Contains(logs.String(), "dedup.ttl") {
		t.Fatalf("%d refusals logged, want 1 naming dedup.ttl:\n%s", n, logs.String())
	}
}

// TestReloadKeepsTheCurrency: a new savings.currency needs a restart like
// the prices: applied alone, it relabelled the money saved so far
// (onceproxy_money_saved_total{currency}), counted at the old prices.
func TestReloadKeepsTheCurrency(t *testing.T) {
	path := writeConfig(t, "log: {level: info}\n")
	a := buildFromFile(t, path, nil)
	before := a.Engine.Stats().Currency
	if err := os.WriteFile(path, []byte("savings: {currency: XTS}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	res, err := a.Reload()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(res.Restart, "savings.currency") || slices.Contains(res.Changed, "savings.currency") {
		t.Errorf("changed %v, restart needed %v; want savings.currency needing a restart", res.Changed, res.Restart)
	}
	if got := a.Engine.Stats().Currency; got != before {
		t.Errorf("currency %q after the reload, want the running %q", got, before)
	}
}

// TestReloadKeepsTheLoginThrottle: a reload that leaves auth alone (here
// only log.level changes) keeps the proxy users' store, so a client that
// used up auth.max_failures_per_minute stays throttled; a new store would
// let a password guesser start over at every reload.
func TestReloadKeepsTheLoginThrottle(t *testing.T) {
	const users = "auth:\n  max_failures_per_minute: 2\n  users: [{name: alice, password_env: ALICE_PW}]\n"
	path := writeConfig(t, users+"log: {level: info}\n")
	a := buildFromFile(t, path, []string{"ALICE_PW=right-password"})
	const client = "127.0.0.9"
	for i := range 2 {
		if ok, _ := a.live.Verify(client, "alice", fmt.Sprint("guess-", i)); ok {
			t.Fatalf("guess %d accepted", i)
		}
	}
	if _, wait := a.live.Verify(client, "alice", "guess-2"); wait == 0 {
		t.Fatal("no throttle after max_failures_per_minute failures")
	}
	if err := os.WriteFile(path, []byte(users+"log: {level: debug}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Reload(); err != nil {
		t.Fatal(err)
	}
	if _, wait := a.live.Verify(client, "alice", "guess-3"); wait == 0 {
		t.Error("a reload that left auth alone lifted the client's login throttle")
	}
}
