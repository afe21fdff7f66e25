package app

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/metrics"
)

// serveApp builds an App from the shipped defaults plus yaml and serves it
// until the test ends.
func serveApp(t *testing.T, yaml string, env []string) *App {
	t.Helper()
	a := buildFromFile(t, writeConfig(t, yaml), env)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return a
}

// scrape reads the app's /metrics, as Prometheus would.
func scrape(t *testing.T, a *App) string {
	t.Helper()
	return scrapeHandler(t, a.Metrics)
}

// scrapeHandler reads m's handler, as Prometheus would.
func scrapeHandler(t testing.TB, m *metrics.Metrics) string {
	t.Helper()
	rec := httptest.NewRecorder()
	m.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("/metrics: %d\n%s", rec.Code, rec.Body)
	}
	return rec.Body.String()
}

// samples returns the label sets (the text between the braces) and values
// of name's samples in a scrape.
func samples(t testing.TB, text, name string) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, l := range strings.Split(text, "\n") {
		rest, ok := strings.CutPrefix(l, name)
		if !ok || (rest[0] != '{' && rest[0] != ' ') {
			continue
		}
		labels, value := "", rest
		if rest[0] == '{' {
			i := strings.LastIndexByte(rest, '}')
			labels, value = rest[1:i], rest[i+1:]
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
		if err != nil {
			t.Fatalf("%q: %v", l, err)
		}
		out[labels] = v
	}
	return out
}

// TestOriginCannotMintSeries: an answer to a protocol switch request
// carries the origin's own X-Cache (the dedup layer never sees it). An
// origin sending a new X-Cache per answer used to add a series per value
// to requests_total and request_duration_seconds, so any client could grow
// the proxy's and Prometheus's memory at will by fetching such an origin;
// a value that is not UTF-8 made the recording panic after the answer.
func TestOriginCannotMintSeries(t *testing.T) {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()["X-Cache"] = []string{strings.TrimPrefix(r.URL.Path, "/")}
		io.WriteString(w, "no switch")
	}))
	defer origin.Close()
	a := serveApp(t, "", nil)

	c, err := net.Dial("tcp", a.Addrs().Proxy)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	paths := []string{"\xff\xfe"}
	for i := range 20 {
		paths = append(paths, "edge-"+strconv.Itoa(i))
	}
	for _, p := range paths {
		fmt.Fprintf(c, "GET %s/%s HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
			origin.URL, p, origin.Listener.Addr())
		c.SetReadDeadline(time.Now().Add(time.Minute)) // a hang fails, not a slow machine
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("%q: %v", p, err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%q: %d", p, resp.StatusCode)
		}
	}
	c.Close()

	// The answers are counted when their bodies are closed, after the
	// client has them: wait for the last one.
	var text string
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
		text = scrape(t, a)
		var n float64
		for _, v := range samples(t, text, "onceproxy_requests_total") {
			n += v
		}
		if n >= float64(len(paths)) || time.Now().After(deadline) {
			if n != float64(len(paths)) {
				t.Errorf("requests_total sums to %v, want %d", n, len(paths))
			}
			break
		}
	}
	for _, name := range []string{"onceproxy_requests_total", "onceproxy_request_duration_seconds_count"} {
		for labels := range samples(t, text, name) {
			if !strings.Contains(labels, `x_cache="none"`) {
				t.Errorf("%s{%s}: want the origin's X-Cache counted as none", name, labels)
			}
		}
	}
}

// TestDashboardListsIdleInstances: the dashboard's instance variable lists
// the instances that export its metric, and "All" means those listed, so
// an instance missing from the list is missing from every panel. It used
// to be read from requests_total, which has no series before the first
// answer: an instance just started, or one no client reaches (its store
// breaker open, its sessions cooling), was not on the dashboard at all.
func TestDashboardListsIdleInstances(t *testing.T) {
	b, err := os.ReadFile("../../deploy/grafana/onceproxy.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Templating struct {
			List []struct {
				Name, Type string
				Query      any
			}
		}
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatal(err)
	}
	text := scrape(t, buildFromFile(t, writeConfig(t, ""), nil)) // no request yet
	labelValues := regexp.MustCompile(`^label_values\((\w+)(\{[^}]*\})?, *instance\)$`)
	found := false
	for _, v := range dash.Templating.List {
		if v.Name != "instance" {
			continue
		}
		q, _ := v.Query.(string)
		m := labelValues.FindStringSubmatch(q)
		if m == nil {
			t.Fatalf("instance variable: query %q, want label_values(<metric>, instance)", q)
		}
		found = true
		if len(samples(t, text, m[1])) == 0 {
			t.Errorf("instance variable reads %s, which an instance that answered nothing yet does not export", m[1])
		}
	}
	if !found {
		t.Fatal("the dashboard has no instance variable")
	}
}

// TestMetricsPassPromtool: what a serving instance with upstream sessions
// exports after a MISS and a HIT is what Prometheus accepts and its linter
// passes (names, TYPE and HELP lines, _total on counters, duplicates).
func TestMetricsPassPromtool(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("promtool is missing (Debian: apt-get install prometheus)")
		}
		t.Skip("promtool not installed (Debian: apt-get install prometheus)")
	}
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "page") }))
	defer origin.Close()
	a := serveApp(t, "", []string{"ONCEPROXY_UPSTREAM_SESSIONS=[{id: s1, url: '" + fp.URL("s1", "http") + "'}, {id: s2, url: '" + fp.URL("s2", "http") + "'}]"})
	c := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: a.Addrs().Proxy})}}
	defer c.CloseIdleConnections()
	for _, p := range []string{"/a", "/a", "/b"} {
		resp, err := c.Get(origin.URL + p)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	text := scrape(t, a)
	for _, name := range []string{"onceproxy_requests_total", "onceproxy_upstream_session_requests_total"} {
		if len(samples(t, text, name)) == 0 {
			t.Errorf("no %s in the scrape", name)
		}
	}
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = strings.NewReader(text)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics: %v\n%s", err, out)
	}
}

// TestCurrencyNotUTF8Refused: savings.currency is the currency label of
// onceproxy_money_saved_total, and Prometheus takes only UTF-8 label
// values. One that was not (an environment variable can hold any bytes)
// passed the configuration, and every scrape then dropped the metric
// without a word: the registry recovers the collector's panic, and the
// handler answers 200 with the rest.
func TestCurrencyNotUTF8Refused(t *testing.T) {
	for _, cur := range []string{"\xff", "US\x00D", "\x1b[2J"} {
		_, err := LoadConfig(shippedConfig, "", []string{"ONCEPROXY_SAVINGS_CURRENCY=" + cur})
		if err == nil || !strings.Contains(err.Error(), "currency") {
			t.Errorf("currency %q: %v, want an error naming savings.currency", cur, err)
		}
	}
	a := serveApp(t, "", []string{"ONCEPROXY_SAVINGS_CURRENCY=EUR"})
	if got := samples(t, scrape(t, a), "onceproxy_money_saved_total"); len(got) != 1 {
		t.Errorf("currency EUR: onceproxy_money_saved_total series %v, want one", got)
	}
}

// TestShorthandProviderNameChecked: upstream.provider.name labels the
// onceproxy_upstream_provider_* series and starts its sessions' ids, as a
// name in upstream.providers does, but only those were checked. A name
// that was not UTF-8 (from the environment) started, and every scrape
// dropped all of its provider's and sessions' series without a word.
func TestShorthandProviderNameChecked(t *testing.T) {
	env := []string{"ONCEPROXY_UPSTREAM_PROVIDER_API=http://127.0.0.1:1/x", "ONCEPROXY_UPSTREAM_PROVIDER_API_KEY=k"}
	for _, name := range []string{"a\xffb", "a.b", "a\"b"} {
		_, err := LoadConfig(shippedConfig, "", append(env, "ONCEPROXY_UPSTREAM_PROVIDER_NAME="+name))
		if err == nil || !strings.Contains(err.Error(), "upstream.provider.name") {
			t.Errorf("provider name %q: %v, want an error naming upstream.provider.name", name, err)
		}
	}
	for _, name := range []string{"", "acme-1"} {
		if _, err := LoadConfig(shippedConfig, "", append(env, "ONCEPROXY_UPSTREAM_PROVIDER_NAME="+name)); err != nil {
			t.Errorf("provider name %q refused: %v", name, err)
		}
	}
}

// TestScrapeErrorsAreLogged: a series the registry cannot write (a label
// value that is not UTF-8) is left out of the scrape, which still answers
// 200 with the rest (promhttp.ContinueOnError), so nothing but a log line
// can tell the operator a metric went missing; there was none.
func TestScrapeErrorsAreLogged(t *testing.T) {
	env := []string{
		"ONCEPROXY_PROXY_LISTEN=127.0.0.1:0", "ONCEPROXY_SOCKS5_LISTEN=", "ONCEPROXY_ADMIN_LISTEN=127.0.0.1:0",
		"ONCEPROXY_MITM_CA_DIR=" + t.TempDir(), "ONCEPROXY_DEDUP_DISK_DIR=" + t.TempDir(), "ONCEPROXY_DEDUP_SPOOL_DIR=" + t.TempDir(),
	}
	cfg, err := LoadConfig(shippedConfig, "", env)
	if err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	a, err := Build(cfg, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil)), Getenv: func(k string) string { return LookupEnv(env, k) }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	a.Metrics.Register(metrics.NewVec("test_broken", "A series with a label value that is not UTF-8.", false, []string{"l"},
		func(emit func(float64, ...string)) { emit(1, "\xff") }))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	res, err := http.Get("http://" + a.Addrs().Admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != http.StatusOK || !strings.Contains(string(body), "onceproxy_cache_entries") {
		t.Fatalf("/metrics: %d, want 200 with the other series\n%.300s", res.StatusCode, body)
	}
	if !strings.Contains(logs.String(), "test_broken") {
		t.Errorf("a scrape dropped onceproxy_test_broken and the log does not say so:\n%s", logs.String())
	}
}

// syncBuffer is a bytes.Buffer the server's goroutines may write while
// the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestMoneySavedNeverGoesBack: onceproxy_money_saved_total is a counter,
// kept in billionths in an int64. A price that makes one answer's saving
// pass 2^63 billionths (savings.* takes any price of 0 or more) wrapped
// it below zero, and so would the sum of savings reaching it: a counter
// that goes back, and a report of money lost.
func TestMoneySavedNeverGoesBack(t *testing.T) {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "page") }))
	defer origin.Close()
	a := serveApp(t, "savings: {price_per_1000_requests: 1e13}\n", nil)
	c := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: a.Addrs().Proxy})}}
	defer c.CloseIdleConnections()
	last := 0.0
	for i := range 4 {
		resp, err := c.Get(origin.URL + "/a") // a MISS, then HITs
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		for _, v := range samples(t, scrape(t, a), "onceproxy_money_saved_total") {
			if v < last {
				t.Fatalf("request %d: onceproxy_money_saved_total went from %g to %g", i+1, last, v)
			}
			last = v
		}
	}
	if last <= 0 {
		t.Errorf("onceproxy_money_saved_total is %g after three HITs at a price, want more than 0", last)
	}
}
