package proxy_test

import (
	"bytes"
	"context"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/admin"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

func dedupOn(c dedup.Config) *dedup.Config {
	c.Enabled = true
	if c.TTL == 0 {
		c.TTL = 45 * time.Second
	}
	return &c
}

type fetched struct {
	status int
	xcache string
	age    string
	body   string
	err    error
}

func fetch(ctx context.Context, c *http.Client, u string) fetched {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	resp, err := c.Do(req)
	if err != nil {
		return fetched{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return fetched{resp.StatusCode, resp.Header.Get("X-Cache"), resp.Header.Get("Age"), string(b), err}
}

// TestStampedeThroughMITM: 500 concurrent identical HTTPS requests through
// the MITM to an origin that takes 200 ms cause exactly one origin request;
// everyone gets 200 and the same body; one MISS, the rest COALESCED; the
// next request is a HIT with Age.
func TestStampedeThroughMITM(t *testing.T) {
	const n = 500
	var w *world
	var originHits atomic.Int64
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		originHits.Add(1)
		time.Sleep(200 * time.Millisecond)
		// Hold the answer until every client is waiting, so the test
		// does not depend on how fast 500 TLS handshakes are.
		testkit.Wait(t, testkit.Patience, func() bool { return w.engine.Stats().Waiters == n }, "500 waiters")
		fmt.Fprintf(rw, "page %s %d", r.URL.Path, time.Now().UnixNano())
	}), false)
	w = newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, dedup: dedupOn(dedup.Config{})})
	c := w.client(false)

	results := make(chan fetched, n)
	for range n {
		go func() { results <- fetch(context.Background(), c, origin.URL+"/stampede") }()
	}
	counts := map[string]int{}
	var first string
	for range n {
		r := <-results
		if r.err != nil || r.status != 200 {
			t.Fatalf("request failed: %+v (%v)", r, r.err)
		}
		if first == "" {
			first = r.body
		} else if r.body != first {
			t.Fatalf("bodies differ: %q vs %q", r.body, first)
		}
		counts[r.xcache]++
	}
	if originHits.Load() != 1 {
		t.Fatalf("origin saw %d requests, want 1", originHits.Load())
	}
	if counts["MISS"] != 1 || counts["COALESCED"] != n-1 {
		t.Fatalf("X-Cache counts %v", counts)
	}
	r := fetch(context.Background(), c, origin.URL+"/stampede")
	if r.xcache != "HIT" || r.age == "" || r.body != first {
		t.Fatalf("next request: %+v", r)
	}
}

// TestStampedeH2 sends the duplicates as streams of one HTTP/2 connection.
func TestStampedeH2(t *testing.T) {
	const n = 100
	var w *world
	var originHits atomic.Int64
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		originHits.Add(1)
		testkit.Wait(t, testkit.Patience, func() bool { return w.engine.Stats().Waiters == n }, "waiters")
		io.WriteString(rw, "h2 page")
	}), false)
	w = newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, dedup: dedupOn(dedup.Config{})})
	c := w.client(true)
	results := make(chan fetched, n)
	for range n {
		go func() { results <- fetch(context.Background(), c, origin.URL+"/h2") }()
	}
	for range n {
		if r := <-results; r.err != nil || r.status != 200 || r.body != "h2 page" {
			t.Fatalf("%+v", r)
		}
	}
	if originHits.Load() != 1 {
		t.Fatalf("origin saw %d", originHits.Load())
	}
}

// TestLeaderClientDisconnects: the client whose request started the flight
// hangs up mid-flight; the others still get the response.
func TestLeaderClientDisconnects(t *testing.T) {
	const followers = 20
	arrived := make(chan struct{}, 1)
	var release *testkit.Gate
	var originHits atomic.Int64
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		originHits.Add(1)
		arrived <- struct{}{}
		if release.Wait(r.Context()) {
			io.WriteString(rw, "survived")
		}
	}), false)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, dedup: dedupOn(dedup.Config{})})
	release = testkit.NewGate(t)

	ctx, cancel := context.WithCancel(context.Background())
	leader := make(chan fetched, 1)
	start := time.Now()
	go func() { leader <- fetch(ctx, w.client(false), origin.URL+"/l") }()
	<-arrived
	res := make(chan fetched, followers)
	c := w.client(false)
	for range followers {
		go func() { res <- fetch(context.Background(), c, origin.URL+"/l") }()
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return w.engine.Stats().Waiters == followers+1 }, "followers waiting")
	cancel() // the leader's client goes away (its connection closes)
	// The leader fails: on the client's side, or, when the proxy heard
	// the client go (a TLS close_notify) before the client stopped reading,
	// with the proxy's own 502 saying so; never with an answer made up
	// while the flight ran.
	if r := <-leader; r.err == nil && !(r.status == http.StatusBadGateway && strings.Contains(r.body, "client_gone")) {
		// The time tells a flight that failed on its own (the header
		// timeout, 30s) from an answer made up while it ran.
		t.Fatalf("leader request did not fail after cancel (%s after it started): %+v", time.Since(start), r)
	}
	release.Open()
	for range followers {
		if r := <-res; r.err != nil || r.status != 200 || r.body != "survived" || r.xcache != "COALESCED" {
			t.Fatalf("follower: %+v", r)
		}
	}
	if originHits.Load() != 1 {
		t.Fatalf("origin saw %d", originHits.Load())
	}
}

func TestFailedFlightEndToEnd(t *testing.T) {
	const n = 10
	var calls atomic.Int64
	var w *world
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			testkit.Wait(t, testkit.Patience, func() bool { return w.engine.Stats().Waiters == n }, "waiters")
			http.Error(rw, "origin broke", http.StatusInternalServerError)
			return
		}
		io.WriteString(rw, "fine now")
	}), false)
	w = newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, dedup: dedupOn(dedup.Config{})})
	c := w.client(false)
	res := make(chan fetched, n)
	for range n {
		go func() { res <- fetch(context.Background(), c, origin.URL+"/f") }()
	}
	for range n {
		if r := <-res; r.status != 500 || !strings.Contains(r.body, "origin broke") {
			t.Fatalf("waiter: %+v", r)
		}
	}
	if r := fetch(context.Background(), c, origin.URL+"/f"); r.status != 200 || r.xcache != "MISS" {
		t.Fatalf("next: %+v", r)
	}
}

// TestErrorResponsesCarryXCache: a failed flight's 502 still says what the
// dedup layer did.
func TestErrorResponsesCarryXCache(t *testing.T) {
	w := newWorld(t, worldOpts{dedup: dedupOn(dedup.Config{})})
	resp, body := w.get(w.client(false), "http://"+testkit.DeadAddr(t)+"/x")
	if resp.StatusCode != 502 || resp.Header.Get("X-Cache") != "MISS" || !strings.HasPrefix(resp.Header.Get("X-Cache-Key"), "v1:") {
		t.Fatalf("got %d X-Cache=%q key=%q %q", resp.StatusCode, resp.Header.Get("X-Cache"), resp.Header.Get("X-Cache-Key"), body)
	}
}

// TestLargeBodyStreamsWithFlatMemory sends a 64 MiB body through the MITM
// with max_body_bytes 1 MiB, with and without a Content-Length: the heap
// never holds it. Over max_object_bytes it streams uncached: BYPASS when
// the origin declares its length, relayed by its flight (MISS) when it
// does not. Under it, it goes through the flight's spool (memory, then a
// file) and is cached on disk.
func TestLargeBodyStreamsWithFlatMemory(t *testing.T) {
	const size = 64 << 20
	chunk := bytes.Repeat([]byte("0123456789abcdef"), 4096) // 64 KiB
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("cl") != "" {
			rw.Header().Set("Content-Length", strconv.Itoa(size))
		}
		for written := 0; written < size; written += len(chunk) {
			if _, err := rw.Write(chunk); err != nil {
				return
			}
		}
	}), false)
	for _, tc := range []struct {
		name      string
		maxObject bytesize.Size
		xcache    map[string]string // by query
		cached    bool
	}{
		{"over max_object_bytes", 8 * bytesize.MiB, map[string]string{"?cl=1": "BYPASS", "": "MISS"}, false},
		{"spooled", 0, map[string]string{"?cl=1": "MISS", "": "MISS"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, worldOpts{
				originCAs: []*x509.Certificate{origin.Certificate()},
				dedup: dedupOn(dedup.Config{MaxBodyBytes: bytesize.MiB, MaxObjectBytes: tc.maxObject,
					SpoolDir: t.TempDir(), Disk: dedup.DiskConfig{Dir: t.TempDir(), MaxBytes: 256 * bytesize.MiB}}),
				quiet: true,
			})
			c := w.client(false)
			for _, q := range []string{"?cl=1", ""} {
				growth, resp := heapGrowth(t, func() *http.Response {
					resp, err := c.Get(origin.URL + "/big" + q)
					if err != nil {
						t.Fatal(err)
					}
					n, err := io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if err != nil || n != size {
						t.Fatalf("%s: read %d bytes, err %v", q, n, err)
					}
					return resp
				})
				if xc := resp.Header.Get("X-Cache"); xc != tc.xcache[q] {
					t.Errorf("%s: X-Cache %q, want %s", q, xc, tc.xcache[q])
				}
				t.Logf("%s: heap in use grew by at most %.1f MiB while streaming 64 MiB", q, float64(growth)/(1<<20))
				if growth > 24<<20 {
					t.Errorf("%s: heap grew by %d MiB: the body was buffered", q, growth>>20)
				}
			}
			st := w.engine.Stats()
			if st.Store.Entries != 0 {
				t.Fatalf("large body in the memory store: %+v", st.Store)
			}
			if cached := st.Disk.Entries == 2; cached != tc.cached {
				t.Fatalf("disk tier: %+v, want cached = %v", st.Disk, tc.cached)
			}
		})
	}
}

// heapGrowth runs f and returns how far the heap in use grew above where
// it started while f ran (sampled), and f's result.
func heapGrowth[T any](t testing.TB, f func() T) (int64, T) {
	runtime.GC()
	var base runtime.MemStats
	runtime.ReadMemStats(&base)
	var peak atomic.Uint64
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		var m runtime.MemStats
		for {
			runtime.ReadMemStats(&m)
			if m.HeapInuse > peak.Load() {
				peak.Store(m.HeapInuse)
			}
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	}()
	v := f()
	close(stop)
	<-sampled
	return int64(peak.Load()) - int64(base.HeapInuse), v
}

// TestAdminCacheEndpoints: /cache/stats adds up and /cache/invalidate works
// by URL and by key.
func TestAdminCacheEndpoints(t *testing.T) {
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		io.WriteString(rw, "x")
	}), false)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, dedup: dedupOn(dedup.Config{})})
	adm := httptest.NewServer(admin.New(admin.Options{Cache: w.engine}))
	defer adm.Close()
	c := w.client(false)

	var key string
	for i := range 4 {
		resp, _ := w.get(c, origin.URL+"/s?a=1")
		if i == 0 {
			key = resp.Header.Get("X-Cache-Key")
		}
	}
	w.get(c, origin.URL+"/t")

	var stats struct {
		Instance dedup.Stats `json:"instance"`
	}
	if err := testkit.GetJSON(adm.URL+"/cache/stats", &stats); err != nil {
		t.Fatal(err)
	}
	s := stats.Instance
	if s.Requests != 5 || s.XCache["HIT"] != 3 || s.XCache["MISS"] != 2 || s.UpstreamRequests != 2 ||
		s.BySource["dedup_cache"] != 3 || s.BySource["api"] != 2 || s.SavingsPct != 60 || s.BytesAvoided != 3 || s.Store.Entries != 2 {
		t.Fatalf("stats do not add up: %+v", s)
	}

	post := func(body string) (int, string) {
		resp, err := http.Post(adm.URL+"/cache/invalidate", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if st, b := post(`{"url": "` + origin.URL + `/s?a=1&utm_campaign=z"}`); st != 200 || !strings.Contains(b, `"invalidated": 1`) {
		t.Fatalf("invalidate url: %d %s", st, b)
	}
	if resp, _ := w.get(c, origin.URL+"/s?a=1"); resp.Header.Get("X-Cache") != "MISS" {
		t.Fatalf("after url invalidation: %s", resp.Header.Get("X-Cache"))
	}
	if st, b := post(`{"key": "` + key + `"}`); st != 200 {
		t.Fatalf("invalidate key: %d %s", st, b)
	}
	if resp, _ := w.get(c, origin.URL+"/s?a=1"); resp.Header.Get("X-Cache") != "MISS" {
		t.Fatalf("after key invalidation: %s", resp.Header.Get("X-Cache"))
	}
	for _, bad := range []string{`{}`, `not json`, `{"url": "x", "key": "y"}`, `{"key": "nope"}`, `{"url": "/rel"}`, `{"bogus": 1}`} {
		if st, b := post(bad); st != 400 || !strings.Contains(b, "error") {
			t.Errorf("%s: %d %s", bad, st, b)
		}
	}
}

// TestCredentialsNeverShared: through the real proxy, two proxy users (and
// two cookies) asking for the same URL each go upstream.
func TestCredentialsNeverShared(t *testing.T) {
	var hits atomic.Int64
	origin := plainOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		fmt.Fprintf(rw, "for %s", r.Header.Get("Cookie"))
	}))
	w := newWorld(t, worldOpts{dedup: dedupOn(dedup.Config{})})
	var mu sync.Mutex
	seen := map[string]string{}
	for _, tc := range []struct{ user, cookie string }{{"alice", ""}, {"bob", ""}, {"alice", "s=1"}, {"alice", "s=2"}, {"alice", "s=2"}} {
		pu := *w.proxyURL
		pu.User = urlUser(tc.user)
		c := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(&pu)}}
		req, _ := http.NewRequest(http.MethodGet, origin.URL+"/me", nil)
		if tc.cookie != "" {
			req.Header.Set("Cookie", tc.cookie)
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		mu.Lock()
		seen[tc.user+"|"+tc.cookie] = resp.Header.Get("X-Cache") + " " + string(b)
		mu.Unlock()
	}
	if hits.Load() != 4 {
		t.Fatalf("origin hits %d, want 4 (one per distinct credential set): %v", hits.Load(), seen)
	}
	if !strings.HasPrefix(seen["alice|s=2"], "HIT") {
		t.Fatalf("same credentials not shared: %v", seen)
	}
}

func urlUser(name string) *url.Userinfo { return url.UserPassword(name, "pw") }
