package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fleettest"
	"github.com/seed-a3c387e8/onceproxy/internal/logbuf"
	"github.com/seed-a3c387e8/onceproxy/internal/pgtest"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// pgEnv is the environment of an instance in a PostgreSQL fleet. Under
// -race on two shared cores a statement may wait for the CPU longer than
// production's timeouts, which would (correctly) trip the breaker and let
// instances fetch alone: the stampede tests give it room.
func pgEnv(t *testing.T, url, schema string, extra ...string) []string {
	env := append(testEnv(t, httptest.NewTLSServer(nil)),
		"ONCEPROXY_POSTGRES_URL="+url, "ONCEPROXY_POSTGRES_SCHEMA="+schema,
		// Three instances and the other tests share one server.
		"ONCEPROXY_POSTGRES_MAX_CONNS=5", "ONCEPROXY_POSTGRES_FLIGHT_CONNS=2",
		"ONCEPROXY_LOG_ACCESS=false", "ONCEPROXY_PROXY_READ_HEADER_TIMEOUT=60s")
	return append(env, extra...)
}

// startLogged is startInstance with the instance's log kept in logs.
func startLogged(t *testing.T, env []string, logs io.Writer) (proxyAddr, adminAddr string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan [2]string, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"-config", writeConfig(t, "log: {level: info}\n")}, env, logs,
			func(p, a string) { ready <- [2]string{p, a} })
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	})
	select {
	case a := <-ready:
		return a[0], a[1]
	case err := <-done:
		t.Fatalf("run: %v", err)
	}
	return "", ""
}

// get fetches u through the proxy at proxyAddr: the status line's code, the
// X-Cache value and the body, or an error.
func get(c *http.Client, u string) (code int, xcache, body string, err error) {
	resp, err := c.Get(u)
	if err != nil {
		return 0, "", "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("X-Cache"), string(b), err
}

type health struct {
	Store          string `json:"store"`
	StoreAvailable bool   `json:"store_available"`
}

func storeAvailable(t *testing.T, admin string) bool {
	var h health
	if err := testkit.GetJSON("http://"+admin+"/health", &h); err != nil {
		t.Error(err)
	}
	if h.Store != "postgres" {
		t.Errorf("/health store %q, want postgres", h.Store)
	}
	return h.StoreAvailable
}

// TestPostgresFleetOfThree runs three complete onceproxy programs sharing
// one PostgreSQL schema: 300 concurrent identical requests spread over
// their proxy ports reach a 200 ms origin once; the fleet statistics add
// up; a page fetched by one is a HIT on the others; invalidation through
// one instance's admin API reaches the memory tier of every instance.
func TestPostgresFleetOfThree(t *testing.T) {
	const perInstance, instances = 100, 3
	const n = perInstance * instances
	url, schema := pgtest.Schema(t)
	var admins []string
	var hits, version atomic.Int64
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		if r.URL.Path == "/fleet" {
			time.Sleep(200 * time.Millisecond)
			// Answer once every client is waiting somewhere in the fleet.
			testkit.Wait(t, testkit.Patience, func() bool {
				w, _ := waiting(admins)
				return w == n
			}, "%d clients waiting in the fleet", n)
		}
		fmt.Fprintf(w, "%s v%d", r.URL.Path, version.Add(1))
	}))
	defer origin.Close()
	logs := &logbuf.Buffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("instance logs:\n%s", logs)
		}
	})
	var proxies []string
	for range instances {
		p, a := startLogged(t, pgEnv(t, url, schema, "ONCEPROXY_POSTGRES_TIMEOUT=3s", "ONCEPROXY_POSTGRES_DIAL_TIMEOUT=3s",
			"ONCEPROXY_POSTGRES_LOCAL_TTL=1m", "ONCEPROXY_LOG_LEVEL=warn"), logs)
		proxies, admins = append(proxies, p), append(admins, a)
	}
	clients := make([]*http.Client, instances)
	for i, p := range proxies {
		clients[i] = plainClient(p, "", "")
		clients[i].Timeout = time.Minute
	}

	results := make(chan string, n)
	for i := range n {
		c := clients[i%instances]
		go func() {
			code, xcache, body, err := get(c, origin.URL+"/fleet")
			if err != nil {
				results <- "error: " + err.Error()
				return
			}
			results <- fmt.Sprintf("%d %s %s", code, xcache, body)
		}()
	}
	counts := map[string]int{}
	for range n {
		r := <-results
		code, rest, _ := strings.Cut(r, " ")
		xcache, body, _ := strings.Cut(rest, " ")
		if code != "200" || body != "/fleet v1" {
			t.Fatalf("client got %q, want 200 with the one answer", r)
		}
		counts[xcache]++
	}
	if counts["MISS"] != 1 || counts["COALESCED"] != n-1 {
		t.Fatalf("X-Cache counts %v, want one MISS, the rest COALESCED", counts)
	}
	if hits.Load() != 1 {
		t.Fatalf("origin saw %d requests, want 1", hits.Load())
	}
	// Statistics (flushed every second) count every instance.
	var st struct {
		Fleet struct {
			Store string `json:"store"`
			Today struct {
				Requests int64            `json:"requests"`
				XCache   map[string]int64 `json:"x_cache"`
			} `json:"today"`
		} `json:"fleet"`
	}
	testkit.Eventually(t, testkit.Patience, func() bool {
		return testkit.GetJSON("http://"+admins[2]+"/cache/stats", &st) == nil && st.Fleet.Today.Requests == n
	}, "the fleet statistics to count %d requests (last: %d)", n, st.Fleet.Today.Requests)
	if st.Fleet.Store != "postgres" || st.Fleet.Today.XCache["MISS"] != 1 || st.Fleet.Today.XCache["COALESCED"] != n-1 {
		t.Fatalf("fleet stats: %+v", st.Fleet)
	}
	// The stampede's flight was led with the fleet's lock, as operators
	// can see.
	for i, admin := range admins {
		if line := grepLines(metricsText(t, admin), `onceproxy_fleet_flights_unlocked_total{store="postgres"} `); line != `onceproxy_fleet_flights_unlocked_total{store="postgres"} 0` {
			t.Errorf("instance %d: /metrics has %q, want the flights led without the lock at 0", i, line)
		}
	}

	// A page fetched by one is a HIT on the others.
	_, xcache, page, err := get(clients[0], origin.URL+"/page")
	if err != nil || xcache != "MISS" {
		t.Fatalf("first fetch: %s %q %v", xcache, page, err)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return settled(admins[0]) }, "instance 0's flight to reach the table")
	for i, c := range clients[1:] {
		if _, xcache, body, err := get(c, origin.URL+"/page"); err != nil || xcache != "HIT" || body != page {
			t.Fatalf("instance %d: %s %q %v, want a HIT of %q", i+1, xcache, body, err, page)
		}
	}
	// Invalidated through instance 0, the page is gone from every
	// instance's memory tier (kept a minute here), not only from the table.
	resp, err := http.Post("http://"+admins[0]+"/cache/invalidate", "application/json", bytes.NewReader([]byte(`{"url": "`+origin.URL+`/page"}`)))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("invalidate: %v %v", err, resp)
	}
	resp.Body.Close()
	for i, c := range clients {
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			_, _, body, err := get(c, origin.URL+"/page")
			if err != nil {
				t.Fatal(err)
			}
			if body != page {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("instance %d still serves the invalidated page %q", i, page)
			}
		}
	}
}

// TestPostgresLeaderKilled runs three onceproxy processes on one schema.
// The leader of a flight is killed (SIGKILL) while it fetches: PostgreSQL
// ends its session and drops its lock, one of the others takes over, and
// every client of the surviving instances gets its answer.
func TestPostgresLeaderKilled(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	bin := filepath.Join(t.TempDir(), "onceproxy")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	url, schema := pgtest.Schema(t)
	release := make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	var hits atomic.Int64
	arrived := make(chan struct{}, 4)
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "answer %d ", hits.Add(1))
		arrived <- struct{}{}
		<-release
		io.WriteString(w, "done")
	}))
	t.Cleanup(origin.Close)
	t.Cleanup(unblock) // before the origin closes, which waits for its handlers

	cfg := writeConfig(t, "log: {format: json}\n")
	start := func(name string) *proc { return runBinary(t, name, bin, cfg, pgEnv(t, url, schema)) }
	a, b, c := start("a"), start("b"), start("c")

	// A leads: its client's request is at the origin.
	go get(plainClient(a.proxyAddr, "", ""), origin.URL+"/slow")
	select {
	case <-arrived:
	case <-time.After(20 * time.Second):
		t.Fatal("A's request never reached the origin")
	}
	const per = 10
	results := make(chan string, 2*per)
	for _, p := range []*proc{b, c} {
		cl := plainClient(p.proxyAddr, "", "")
		cl.Timeout = time.Minute
		for range per {
			go func() {
				code, _, body, err := get(cl, origin.URL+"/slow")
				if err != nil {
					results <- "error: " + err.Error()
					return
				}
				results <- fmt.Sprintf("%d %s", code, body)
			}()
		}
	}
	testkit.Eventually(t, testkit.Patience, func() bool {
		w, _ := waiting([]string{b.admin, c.admin})
		return w == 2*per
	}, "B's and C's %d clients waiting", 2*per)
	if err := a.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case <-arrived: // B or C took over
	case <-time.After(15 * time.Second):
		t.Fatal("nobody took over the killed leader's flight")
	}
	unblock()
	answer := ""
	for range 2 * per {
		r := <-results
		if !strings.HasPrefix(r, "200 answer 2 done") {
			t.Fatalf("client of a surviving instance got %q, want the takeover's answer", r)
		}
		if answer == "" {
			answer = r
		}
	}
	if hits.Load() != 2 {
		t.Fatalf("origin saw %d requests, want 2 (the killed leader's and one takeover)", hits.Load())
	}
}

// TestPostgresOutageUnderLoad: PostgreSQL stopped under steady load costs
// no client request; what goes upstream meanwhile says BYPASS; after it
// returns, sharing is back within the breaker interval; and an instance
// without traffic reports the truth in /health throughout.
func TestPostgresOutageUnderLoad(t *testing.T) {
	pg := pgtest.Start(t)
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(2 * time.Millisecond)
		fmt.Fprintf(w, "page %s", r.URL.RequestURI())
	}))
	defer origin.Close()
	const interval = 500 * time.Millisecond
	logs := &logbuf.Buffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("instance logs:\n%s", logs)
		}
	})
	env := func() []string {
		return pgEnv(t, pg.URL, "onceproxy", "ONCEPROXY_POSTGRES_BREAKER_INTERVAL="+interval.String(),
			"ONCEPROXY_POSTGRES_BREAKER_FAILURES=2", "ONCEPROXY_POSTGRES_TIMEOUT=500ms")
	}
	pa, aa := startLogged(t, env(), logs)
	pb, ab := startLogged(t, env(), logs)
	_, idle := startLogged(t, env(), logs)
	admins := []string{aa, ab, idle}
	clients := []*http.Client{plainClient(pa, "", ""), plainClient(pb, "", "")}
	for _, a := range admins {
		if !storeAvailable(t, a) {
			t.Fatalf("%s: store not available at start", a)
		}
	}

	stop := fleettest.Load(8, func(w, i int) fleettest.Got {
		code, xcache, _, err := get(clients[(w+i)%2], fmt.Sprintf("%s/load/%d", origin.URL, i%50))
		return fleettest.Got{Status: code, XCache: xcache, Err: err}
	})
	time.Sleep(300 * time.Millisecond)
	pg.Stop()
	stopped := time.Now()
	for _, a := range admins {
		for storeAvailable(t, a) {
			if time.Since(stopped) > 15*time.Second {
				t.Fatalf("%s still says store_available with PostgreSQL stopped", a)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	for i, c := range clients {
		code, xcache, _, err := get(c, fmt.Sprintf("%s/during/%d", origin.URL, i))
		if err != nil || code != 200 || xcache != "BYPASS" {
			t.Errorf("instance %d, a new page while PostgreSQL is down: %d %s %v, want 200 BYPASS", i, code, xcache, err)
		}
	}
	time.Sleep(300 * time.Millisecond) // load while PostgreSQL is down
	pg.Start()
	restarted := time.Now()
	for deadline := restarted.Add(15 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		u := fmt.Sprintf("%s/after/%d", origin.URL, time.Now().UnixNano())
		if _, x, _, _ := get(clients[0], u); x == "MISS" {
			if _, x, _, _ := get(clients[1], u); x == "HIT" {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("sharing never resumed")
		}
	}
	resumed := time.Since(restarted)
	for !storeAvailable(t, idle) {
		if time.Since(restarted) > 15*time.Second {
			t.Fatal("the idle instance never saw PostgreSQL back")
		}
		time.Sleep(10 * time.Millisecond)
	}
	idleBack := time.Since(restarted)
	counts, errs := stop()
	if len(errs) > 0 {
		t.Fatalf("%d client requests failed during the outage, first: %s", len(errs), errs[0])
	}
	t.Logf("X-Cache during the run: %v; sharing back %s and the idle instance %s after the restart", counts, resumed, idleBack)
	// A restart of the cluster is part of the time measured; the breaker
	// interval is what onceproxy adds to it.
	if limit := interval + 2*time.Second; resumed > limit || idleBack > limit {
		t.Fatalf("sharing took %s (idle instance %s) to come back; breaker interval %s", resumed, idleBack, interval)
	}
}

// TestPostgresSchemaOfAnotherVersionStopsStart: an instance pointed at a
// schema that another version of onceproxy made refuses to start, saying
// why.
func TestPostgresSchemaOfAnotherVersionStopsStart(t *testing.T) {
	url, schema := pgtest.Schema(t)
	pgtest.Exec(t, url, "CREATE SCHEMA "+schema+"; CREATE TABLE "+schema+".meta (name text PRIMARY KEY, value text NOT NULL);"+
		"INSERT INTO "+schema+".meta VALUES ('schema_version', '7')")
	err := run(context.Background(), []string{"-config", writeConfig(t, "log: {level: error}\n")}, pgEnv(t, url, schema), io.Discard, nil)
	if err == nil || !strings.Contains(err.Error(), `schema version "7"`) || !strings.Contains(err.Error(), "postgres.schema") {
		t.Fatalf("run on a schema of version 7: %v", err)
	}
}
