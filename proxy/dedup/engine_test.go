package dedup

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/andybalholm/brotli"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// countingTransport is the seam between the engine and the network: a real
// http.Transport to a loopback origin that counts what went upstream.
type countingTransport struct {
	rt http.RoundTripper
	n  atomic.Int64
	// onTrip, if set before the first request, sees each request first.
	onTrip func(*http.Request)
}

func (c *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	if c.onTrip != nil {
		c.onTrip(r)
	}
	return c.rt.RoundTrip(r)
}

type fixture struct {
	t      *testing.T
	eng    *Engine
	store  *MemoryStore
	up     *countingTransport
	origin *httptest.Server
}

func newFixture(t *testing.T, cfg Config, h http.Handler) *fixture {
	t.Helper()
	origin := httptest.NewServer(h)
	t.Cleanup(origin.Close)
	return newFixtureOn(t, cfg, origin, &http.Transport{DisableCompression: true})
}

// newFixtureOn is newFixture with an origin and the transport to it
// (HTTPS, HTTP/2) of the caller's.
func newFixtureOn(t *testing.T, cfg Config, origin *httptest.Server, tr *http.Transport) *fixture {
	t.Helper()
	t.Cleanup(tr.CloseIdleConnections)
	up := &countingTransport{rt: tr}
	cfg.Enabled = true
	cfg = cfg.WithDefaults()
	store := NewMemoryStore(int64(cfg.Memory.MaxBytes))
	t.Cleanup(store.Close)
	eng, err := New(cfg, Options{Store: store, Next: up, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(eng.Close)
	return &fixture{t: t, eng: eng, store: store, up: up, origin: origin}
}

type result struct {
	status int
	xcache string
	key    string
	header http.Header
	body   string
	err    error
}

// do sends one request through the engine the way the proxy does.
func (f *fixture) do(ctx context.Context, method, path string, hdr http.Header, body string) result {
	var rb io.Reader
	if body != "" {
		rb = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, f.origin.URL+path, rb)
	if err != nil {
		f.t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header[k] = v
	}
	resp, err := f.eng.RoundTrip(req)
	if err != nil {
		r := result{err: err}
		if e, ok := err.(*Error); ok {
			r.xcache, r.key = e.CacheHeaders()
		}
		return r
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return result{resp.StatusCode, resp.Header.Get(HeaderCache), resp.Header.Get(HeaderCacheKey), resp.Header, string(b), err}
}

func (f *fixture) get(path string, kv ...string) result {
	h := http.Header{}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Add(kv[i], kv[i+1])
	}
	return f.do(context.Background(), http.MethodGet, path, h, "")
}

func okHandler(w http.ResponseWriter, r *http.Request) {
	fmt.Fprintf(w, "body of %s", r.URL.RequestURI())
}

func TestMissThenHitWithAge(t *testing.T) {
	f := newFixture(t, Config{TTL: time.Minute}, http.HandlerFunc(okHandler))
	r1 := f.get("/a")
	if r1.status != 200 || r1.xcache != CacheMiss || r1.body != "body of /a" {
		t.Fatalf("first: %+v", r1)
	}
	r2 := f.get("/a")
	if r2.xcache != CacheHit || r2.body != r1.body || r2.key != r1.key {
		t.Fatalf("second: %+v", r2)
	}
	if r2.header.Get("Age") == "" {
		t.Error("HIT without Age")
	}
	if r1.header.Get("Age") != "" {
		t.Error("MISS with Age")
	}
	if n := f.up.n.Load(); n != 1 {
		t.Fatalf("upstream requests = %d, want 1", n)
	}
}

func TestStampedeCoalesces(t *testing.T) {
	const n = 200
	release := make(chan struct{})
	var originHits atomic.Int64
	f := newFixture(t, Config{TTL: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		originHits.Add(1)
		<-release
		okHandler(w, r)
	}))
	results := make(chan result, n)
	for range n {
		go func() { results <- f.get("/hot?b=2&a=1") }()
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.Stats().Waiters == n }, "%d waiters", n)
	close(release)
	counts := map[string]int{}
	for range n {
		r := <-results
		if r.status != 200 || r.body != "body of /hot?b=2&a=1" {
			t.Fatalf("bad result %+v", r)
		}
		counts[r.xcache]++
	}
	if counts[CacheMiss] != 1 || counts[CacheCoalesced] != n-1 {
		t.Fatalf("X-Cache counts %v, want 1 MISS and %d COALESCED", counts, n-1)
	}
	if originHits.Load() != 1 {
		t.Fatalf("origin saw %d requests", originHits.Load())
	}
	st := f.eng.Stats()
	if st.Requests != n || st.RequestsAvoided != n-1 || st.UpstreamRequests != 1 || st.BySource["dedup_wait"] != n-1 {
		t.Fatalf("stats %+v", st)
	}
}

// TestLeaderDisconnectDoesNotCancelFlight: the first client gives up; the
// fetch it started still answers everyone else. An HTTP/2 leader returns
// at once (its client resets one stream and goes on with the others); an
// HTTP/1.x leader, whose flight runs on its own goroutine (Engine.start),
// returns once the flight has its result, with its client's error rather
// than the answer.
func TestLeaderDisconnectDoesNotCancelFlight(t *testing.T) {
	for _, major := range []int{2, 1} {
		t.Run(fmt.Sprintf("HTTP/%d", major), func(t *testing.T) {
			arrived := make(chan struct{}, 1)
			release := make(chan struct{})
			f := newFixture(t, Config{TTL: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				arrived <- struct{}{}
				select {
				case <-release:
				case <-r.Context().Done():
					return
				}
				okHandler(w, r)
			}))
			var tripOn atomic.Int64 // the goroutine that went upstream
			f.up.onTrip = func(*http.Request) { tripOn.Store(goroutineID()) }
			ctx, cancel := context.WithCancel(context.Background())
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, f.origin.URL+"/x", nil)
			if err != nil {
				t.Fatal(err)
			}
			req.ProtoMajor, req.ProtoMinor = major, 0
			var leaderOn int64
			leader := make(chan error, 1)
			go func() {
				leaderOn = goroutineID()
				resp, err := f.eng.RoundTrip(req)
				if err == nil {
					resp.Body.Close()
				}
				leader <- err
			}()
			<-arrived
			const n = 20
			followers := make(chan result, n)
			for range n {
				go func() { followers <- f.get("/x") }()
			}
			testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.Stats().Waiters == n+1 }, "%d waiters", n+1)
			cancel()
			if major == 2 {
				select {
				case err := <-leader:
					if !errors.Is(err, context.Canceled) {
						t.Fatalf("leader: want its context's error, got %v", err)
					}
				case <-time.After(testkit.Patience):
					t.Fatal("the HTTP/2 leader is still held by the flight its client left")
				}
			}
			close(release)
			for range n {
				if r := <-followers; r.status != 200 || r.xcache != CacheCoalesced || r.body != "body of /x" {
					t.Fatalf("follower: %+v", r)
				}
			}
			if major == 1 {
				if err := <-leader; !errors.Is(err, context.Canceled) {
					t.Fatalf("leader: want its context's error, got %v", err)
				}
			}
			// An HTTP/1.x leader's own goroutine fetched; an HTTP/2
			// leader's handed the flight to a worker.
			if inline := tripOn.Load() == leaderOn; inline != (major == 1) {
				t.Fatalf("HTTP/%d: the fetch ran on the leader's goroutine: %v", major, inline)
			}
			if got := f.get("/x"); got.xcache != CacheHit {
				t.Fatalf("after: %+v", got)
			}
			if f.up.n.Load() != 1 {
				t.Fatalf("upstream = %d", f.up.n.Load())
			}
		})
	}
}

// TestFailedFlightAnswersItsWaitersAndCachesNothing: a 500 goes to everyone
// waiting on that flight; the next request starts a fresh one.
func TestFailedFlightAnswersItsWaitersAndCachesNothing(t *testing.T) {
	var calls atomic.Int64
	release := make(chan struct{})
	f := newFixture(t, Config{TTL: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			<-release
			http.Error(w, "boom", http.StatusInternalServerError)
			return
		}
		okHandler(w, r)
	}))
	const n = 10
	res := make(chan result, n)
	for range n {
		go func() { res <- f.get("/flaky") }()
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.Stats().Waiters == n }, "%d waiters", n)
	close(release)
	for range n {
		if r := <-res; r.status != 500 {
			t.Fatalf("waiter of the failed flight: %+v", r)
		}
	}
	r := f.get("/flaky")
	if r.status != 200 || r.xcache != CacheMiss {
		t.Fatalf("next request: %+v", r)
	}
	if r := f.get("/flaky"); r.xcache != CacheHit {
		t.Fatalf("then: %+v", r)
	}
}

func TestConnectionErrorFansOutAsError(t *testing.T) {
	f := newFixture(t, Config{TTL: time.Minute}, http.HandlerFunc(okHandler))
	f.origin.Close() // nothing listens any more
	r := f.get("/down")
	if r.err == nil || r.xcache != CacheMiss || r.key == "" {
		t.Fatalf("got %+v", r)
	}
}

func TestKeying(t *testing.T) {
	f := newFixture(t, Config{TTL: time.Minute}, http.HandlerFunc(okHandler))
	base := f.get("/q?b=2&a=1&utm_source=x")
	if r := f.get("/q?a=1&b=2"); r.xcache != CacheHit || r.key != base.key {
		t.Errorf("reordered query without tracking param: %+v", r)
	}
	a1 := f.get("/auth", "Authorization", "Bearer one")
	a2 := f.get("/auth", "Authorization", "Bearer two")
	if a1.xcache != CacheMiss || a2.xcache != CacheMiss || a1.key == a2.key {
		t.Errorf("different Authorization shared: %s %s", a1.xcache, a2.xcache)
	}
	c1 := f.get("/c", "Cookie", "sid=1")
	c2 := f.get("/c", "Cookie", "sid=2")
	if c2.xcache != CacheMiss || c1.key == c2.key {
		t.Errorf("different Cookie shared")
	}
	u1 := f.do(clientinfo.With(context.Background(), clientinfo.Info{User: "alice", Account: "alice"}), http.MethodGet, "/u", nil, "")
	u2 := f.do(clientinfo.With(context.Background(), clientinfo.Info{User: "bob", Account: "bob"}), http.MethodGet, "/u", nil, "")
	if u2.xcache != CacheMiss || u1.key == u2.key {
		t.Errorf("different proxy users shared")
	}
	if r := f.get("/q?a=1&b=2", "Accept-Encoding", "gzip"); r.xcache != CacheHit {
		t.Errorf("Accept-Encoding split the key: %+v", r.xcache)
	}
	// A Range request is answered from the whole response, never the
	// other way round.
	if r := f.get("/q?a=1&b=2", "Range", "bytes=0-3"); r.xcache != CacheHit || r.status != http.StatusPartialContent || r.body != "body" || r.key != base.key {
		t.Errorf("Range from the cached response: %d %s %q", r.status, r.xcache, r.body)
	}
	full := f.get("/r")
	part := f.get("/r2", "Range", "bytes=0-3")
	if part.xcache != CacheMiss || part.key == full.key {
		t.Errorf("Range with nothing cached: %s", part.xcache)
	}
	if r := f.get("/r2"); r.xcache != CacheMiss {
		t.Errorf("a plain request answered from a Range response: %s", r.xcache)
	}
}

func TestPostBypassUnlessRuleOptsIn(t *testing.T) {
	var seen sync.Map
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		seen.Store(string(b), true)
		fmt.Fprintf(w, "solved %s", b)
	})
	f := newFixture(t, Config{TTL: time.Minute, Rules: []RuleConfig{{
		Name: "captcha", PathPrefix: "/in.php", Methods: []string{http.MethodPost},
		BodyFields: []string{"method", "googlekey", "pageurl", "action"}, ShareCredentials: true, TTL: ptr(180 * time.Second),
	}}}, h)
	form := http.Header{"Content-Type": {"application/x-www-form-urlencoded"}}
	ctx := context.Background()

	if r := f.do(ctx, http.MethodPost, "/other", form, "a=1"); r.xcache != CacheBypass || r.body != "solved a=1" {
		t.Fatalf("POST without a rule: %+v", r)
	}
	if r := f.do(ctx, http.MethodPost, "/other", form, "a=1"); r.xcache != CacheBypass {
		t.Fatalf("POST without a rule, again: %+v", r)
	}
	w1 := f.do(ctx, http.MethodPost, "/in.php", form, "key=SECRET1&method=userrecaptcha&googlekey=K&pageurl=P")
	w2 := f.do(ctx, http.MethodPost, "/in.php", form, "key=SECRET2&method=userrecaptcha&googlekey=K&pageurl=P")
	if w1.xcache != CacheMiss || w2.xcache != CacheHit || w2.body != w1.body {
		t.Fatalf("same task, different API keys: %+v / %+v", w1, w2)
	}
	if r := f.do(ctx, http.MethodPost, "/in.php", form, "key=SECRET1&method=userrecaptcha&googlekey=OTHER&pageurl=P"); r.xcache != CacheMiss {
		t.Fatalf("different sitekey shared: %+v", r)
	}
	// The upstream got the request body intact.
	if _, ok := seen.Load("key=SECRET1&method=userrecaptcha&googlekey=K&pageurl=P"); !ok {
		t.Fatal("origin did not receive the leader's body")
	}
}

func ptr[T any](v T) *T { return &v }

func TestRequestBodyOverLimitBypasses(t *testing.T) {
	f := newFixture(t, Config{TTL: time.Minute, MaxRequestBodyBytes: 1024, Rules: []RuleConfig{{Methods: []string{"POST"}}}},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			fmt.Fprintf(w, "%d", len(b))
		}))
	big := strings.Repeat("x", 5000)
	if r := f.do(context.Background(), http.MethodPost, "/p", nil, big); r.xcache != CacheBypass || r.body != "5000" {
		t.Fatalf("large POST: %+v", r)
	}
}

func TestNotCachedButCoalesced(t *testing.T) {
	f := newFixture(t, Config{TTL: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/cookie":
			http.SetCookie(w, &http.Cookie{Name: "s", Value: "1"})
		case "/nostore":
			w.Header().Set("Cache-Control", "no-store")
		case "/private":
			w.Header().Set("Cache-Control", "max-age=60, private")
		case "/teapot":
			w.WriteHeader(http.StatusTeapot)
		case "/429":
			w.WriteHeader(http.StatusTooManyRequests)
		case "/varystar":
			w.Header().Set("Vary", "*")
		}
		okHandler(w, r)
	}))
	for _, p := range []string{"/cookie", "/nostore", "/private", "/teapot", "/429", "/varystar"} {
		f.get(p)
		if r := f.get(p); r.xcache != CacheMiss {
			t.Errorf("%s was cached (%s)", p, r.xcache)
		}
	}
	if r := f.get("/plain"); r.xcache != CacheMiss {
		t.Fatal(r.xcache)
	}
	if r := f.get("/plain"); r.xcache != CacheHit {
		t.Errorf("/plain was not cached")
	}
}

func TestVaryIsHonoured(t *testing.T) {
	f := newFixture(t, Config{TTL: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Vary", "User-Agent, Accept-Encoding")
		fmt.Fprintf(w, "ua=%s", r.UserAgent())
	}))
	f.get("/v", "User-Agent", "a")
	if r := f.get("/v", "User-Agent", "a"); r.xcache != CacheHit {
		t.Errorf("same UA: %s", r.xcache)
	}
	b := f.get("/v", "User-Agent", "b")
	if b.xcache != CacheMiss || b.body != "ua=b" {
		t.Errorf("other UA got %s %q", b.xcache, b.body)
	}
	// Each variant keeps its own copy: alternating clients do not evict
	// each other.
	for range 3 {
		for _, ua := range []string{"a", "b"} {
			if r := f.get("/v", "User-Agent", ua); r.xcache != CacheHit || r.body != "ua="+ua {
				t.Errorf("UA %s: %s %q", ua, r.xcache, r.body)
			}
		}
	}
	if n := f.up.n.Load(); n != 2 {
		t.Errorf("origin fetched %d times for two variants", n)
	}
	// The variant's X-Cache-Key removes that variant.
	if err := f.eng.InvalidateKey(context.Background(), b.key); err != nil {
		t.Fatal(err)
	}
	if r := f.get("/v", "User-Agent", "b"); r.xcache != CacheMiss {
		t.Errorf("after invalidating variant b: %s", r.xcache)
	}
	if r := f.get("/v", "User-Agent", "a"); r.xcache != CacheHit {
		t.Errorf("variant a lost with b: %s", r.xcache)
	}
}

// TestVaryWhileCoalescing: clients that wait on one flight but send other
// values of a header the response varies on do not get the leader's
// variant; each variant is fetched once, for everyone who wants it.
func TestVaryWhileCoalescing(t *testing.T) {
	const perUA = 10
	var f *fixture
	f = newFixture(t, Config{TTL: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.UserAgent() == "desktop" {
			// The first flight answers once every client waits on it.
			testkit.Wait(t, testkit.Patience, func() bool { return f.eng.Stats().Waiters == 2*perUA }, "%d waiters", 2*perUA)
		}
		w.Header().Set("Vary", "User-Agent")
		fmt.Fprintf(w, "page for %s", r.UserAgent())
	}))
	first := make(chan result, 1)
	go func() { first <- f.get("/page", "User-Agent", "desktop") }()
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.Stats().Waiters == 1 }, "one waiter")
	res := make(chan result, 2*perUA)
	for i := range 2*perUA - 1 {
		ua := []string{"desktop", "mobile"}[i%2]
		go func() {
			r := f.get("/page", "User-Agent", ua)
			r.header = http.Header{"Ua": {ua}}
			res <- r
		}()
	}
	if r := <-first; r.xcache != CacheMiss || r.body != "page for desktop" {
		t.Fatalf("leader: %+v", r)
	}
	for range 2*perUA - 1 {
		r := <-res
		ua := r.header.Get("Ua")
		if r.err != nil || r.status != 200 || r.body != "page for "+ua {
			t.Fatalf("%s client got %+v", ua, r)
		}
	}
	if n := f.up.n.Load(); n != 2 {
		t.Errorf("origin fetched %d times for two variants, want 2", n)
	}
}

func TestTTLZeroCoalescesOnly(t *testing.T) {
	f := newFixture(t, Config{Rules: []RuleConfig{{PathPrefix: "/res.php", TTL: ptr(time.Duration(0))}}, TTL: time.Minute},
		http.HandlerFunc(okHandler))
	f.get("/res.php?id=1")
	if r := f.get("/res.php?id=1"); r.xcache != CacheMiss {
		t.Fatalf("ttl 0 cached: %s", r.xcache)
	}
}

func TestTTLExpiry(t *testing.T) {
	f := newFixture(t, Config{TTL: 150 * time.Millisecond}, http.HandlerFunc(okHandler))
	f.get("/ttl")
	if r := f.get("/ttl"); r.xcache != CacheHit {
		t.Fatalf("within TTL: %s", r.xcache)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return f.get("/ttl").xcache == CacheMiss }, "the entry to expire")
}

func TestDedupOffRule(t *testing.T) {
	f := newFixture(t, Config{TTL: time.Minute, Rules: []RuleConfig{{Host: "127.0.0.1", PathPrefix: "/checkout", Dedup: ptr(false)}}},
		http.HandlerFunc(okHandler))
	f.get("/checkout/1")
	if r := f.get("/checkout/1"); r.xcache != CacheBypass || !strings.HasPrefix(r.key, "v1:") {
		t.Fatalf("dedup off: %+v", r)
	}
}

func TestHeadFromCachedGet(t *testing.T) {
	f := newFixture(t, Config{TTL: time.Minute}, http.HandlerFunc(okHandler))
	g := f.get("/h")
	r := f.do(context.Background(), http.MethodHead, "/h", nil, "")
	if r.xcache != CacheHit || r.body != "" || r.header.Get("Content-Length") != fmt.Sprint(len(g.body)) {
		t.Fatalf("HEAD: %+v", r)
	}
	if f.up.n.Load() != 1 {
		t.Fatalf("HEAD went upstream")
	}
	// A HEAD with nothing cached goes upstream and keeps the origin's length.
	h := f.do(context.Background(), http.MethodHead, "/h2", nil, "")
	if h.xcache != CacheMiss || h.header.Get("Content-Length") != fmt.Sprint(len("body of /h2")) {
		t.Fatalf("HEAD miss: %+v", h)
	}
}

func TestStoredCodingDecodedForClientsThatNeedIt(t *testing.T) {
	plain := strings.Repeat("compressible text ", 200)
	f := newFixture(t, Config{TTL: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ae := r.Header.Get("Accept-Encoding")
		switch {
		case strings.Contains(ae, "br"):
			w.Header().Set("Content-Encoding", "br")
			w.Header().Set("ETag", `"v1-br"`)
			bw := brotli.NewWriter(w)
			io.WriteString(bw, plain)
			bw.Close()
		case strings.Contains(ae, "gzip"):
			w.Header().Set("Content-Encoding", "gzip")
			gw := gzip.NewWriter(w)
			io.WriteString(gw, plain)
			gw.Close()
		default:
			io.WriteString(w, plain)
		}
	}))
	lead := f.get("/enc", "Accept-Encoding", "gzip, br")
	if lead.header.Get("Content-Encoding") != "br" || lead.body == plain {
		t.Fatalf("leader did not get the origin's br bytes")
	}
	for _, tc := range []struct{ ae, wantCE string }{
		{"", ""},
		{"gzip", ""},
		{"br;q=0.5, gzip", "br"},
		{"*", "br"},
		{"br;q=0", ""},
	} {
		r := f.get("/enc", "Accept-Encoding", tc.ae)
		if r.xcache != CacheHit || r.header.Get("Content-Encoding") != tc.wantCE {
			t.Errorf("AE %q: %s CE=%q", tc.ae, r.xcache, r.header.Get("Content-Encoding"))
			continue
		}
		if tc.wantCE == "" {
			if r.body != plain || r.header.Get("Content-Length") != fmt.Sprint(len(plain)) || r.header.Get("ETag") != `W/"v1-br"` {
				t.Errorf("AE %q: decoded body wrong (len %d, CL %s, ETag %s)", tc.ae, len(r.body), r.header.Get("Content-Length"), r.header.Get("ETag"))
			}
		} else if r.body != lead.body {
			t.Errorf("AE %q: stored bytes altered", tc.ae)
		}
	}
	if f.up.n.Load() != 1 {
		t.Fatalf("upstream = %d, want 1", f.up.n.Load())
	}
}

// TestStoredCodingOfABodylessAnswer: an answer stored without a body (a
// HEAD's, a 304) whose header names a content coding is served to a client
// that does not accept the coding without the coding's fields, from the
// cache. There is nothing to decode; decoding nothing failed, and every
// such client went upstream (BYPASS).
func TestStoredCodingOfABodylessAnswer(t *testing.T) {
	f := newFixture(t, Config{TTL: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Set("Content-Length", "1234")
		w.Header().Set("ETag", `"v1"`)
	}))
	lead := f.do(context.Background(), http.MethodHead, "/h", http.Header{"Accept-Encoding": {"gzip"}}, "")
	if lead.xcache != CacheMiss || lead.header.Get("Content-Encoding") != "gzip" {
		t.Fatalf("HEAD accepting gzip: %s, %v", lead.xcache, lead.header)
	}
	r := f.do(context.Background(), http.MethodHead, "/h", nil, "")
	if r.xcache != CacheHit {
		t.Fatalf("HEAD accepting no coding: %s, want a HIT", r.xcache)
	}
	if ce, cl, etag := r.header.Get("Content-Encoding"), r.header.Get("Content-Length"), r.header.Get("ETag"); ce != "" || cl == "1234" || etag != `W/"v1"` {
		t.Errorf("HEAD accepting no coding got Content-Encoding %q, Content-Length %q, ETag %q; want none, not the coded length, and a weak ETag", ce, cl, etag)
	}
	if n := f.up.n.Load(); n != 1 {
		t.Errorf("upstream = %d, want 1", n)
	}
}

// TestOverObjectLimit: a response that declares a body over
// max_object_bytes streams to its own client uncached (BYPASS); one of
// unknown length that grows past it is relayed whole to its reader and not
// cached either.
func TestOverObjectLimit(t *testing.T) {
	const size = 3 << 20
	f := newFixture(t, Config{TTL: time.Minute, MaxBodyBytes: 16 * bytesize.KiB, MaxObjectBytes: 64 * bytesize.KiB,
		SpoolDir: t.TempDir()}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("chunked") == "" {
			w.Header().Set("Content-Length", fmt.Sprint(size))
		}
		w.Write(bytes.Repeat([]byte("z"), size))
	}))
	for _, tc := range []struct{ path, xcache string }{{"/big", CacheBypass}, {"/big?chunked=1", CacheMiss}} {
		for i := range 2 {
			r := f.get(tc.path)
			if r.status != 200 || len(r.body) != size || r.xcache != tc.xcache || r.err != nil {
				t.Fatalf("%s #%d: status %d len %d X-Cache %s err %v", tc.path, i, r.status, len(r.body), r.xcache, r.err)
			}
		}
	}
	if st := f.eng.Stats(); st.Store.Entries != 0 || st.Disk != nil {
		t.Fatalf("a large body was cached: %+v", st)
	}
	if n := f.up.n.Load(); n != 4 {
		t.Fatalf("upstream = %d, want 4", n)
	}
}

func TestInvalidate(t *testing.T) {
	f := newFixture(t, Config{TTL: time.Minute}, http.HandlerFunc(okHandler))
	a := f.get("/inv?x=1", "Accept", "text/html")
	f.get("/inv?x=1", "Accept", "application/json")
	f.do(context.Background(), http.MethodHead, "/inv?x=1", nil, "")
	f.get("/other")
	n, err := f.eng.InvalidateURL(context.Background(), f.origin.URL+"/inv?utm_source=z&x=1#frag")
	if err != nil || n != 3 {
		t.Fatalf("InvalidateURL = %d, %v; want 3 variants", n, err)
	}
	if r := f.get("/inv?x=1", "Accept", "text/html"); r.xcache != CacheMiss {
		t.Errorf("variant survived: %s", r.xcache)
	}
	if r := f.get("/other"); r.xcache != CacheHit {
		t.Errorf("unrelated URL invalidated")
	}
	if err := f.eng.InvalidateKey(context.Background(), a.key); err != nil {
		t.Fatal(err)
	}
	if r := f.get("/inv?x=1", "Accept", "text/html"); r.xcache != CacheMiss {
		t.Errorf("key survived invalidation: %s", r.xcache)
	}
	if err := f.eng.InvalidateKey(context.Background(), "nope"); err == nil {
		t.Error("bad key accepted")
	}
	if _, err := f.eng.InvalidateURL(context.Background(), "/relative"); err == nil {
		t.Error("relative URL accepted")
	}
}

func TestEachWaiterOwnsItsResponse(t *testing.T) {
	release := make(chan struct{})
	f := newFixture(t, Config{TTL: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-release
		w.Header().Set("X-Shared", "orig")
		okHandler(w, r)
	}))
	const n = 30
	var wg sync.WaitGroup
	errs := make(chan string, n*2)
	run := func() {
		defer wg.Done()
		req, _ := http.NewRequest(http.MethodGet, f.origin.URL+"/own", nil)
		resp, err := f.eng.RoundTrip(req)
		if err != nil {
			errs <- err.Error()
			return
		}
		// Mutating our copy must not affect anyone else (the race
		// detector checks the rest).
		if resp.Header.Get("X-Shared") != "orig" {
			errs <- "header changed by another waiter"
		}
		resp.Header.Set("X-Shared", "mine")
		resp.Header.Del("Content-Type")
		b, _ := io.ReadAll(resp.Body)
		if string(b) != "body of /own" {
			errs <- "body " + string(b)
		}
	}
	for range n {
		wg.Add(1)
		go run()
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.Stats().Waiters == n }, "%d waiters", n)
	close(release)
	wg.Wait()
	for range n {
		wg.Add(1)
		go run() // hits, concurrently
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

// panicTransport panics inside the flight: the waiters get an error and the
// process survives.
type panicTransport struct{}

func (panicTransport) RoundTrip(*http.Request) (*http.Response, error) { panic("upstream exploded") }

func TestPanicInFlightIsRecovered(t *testing.T) {
	cfg := Config{Enabled: true, TTL: time.Minute}.WithDefaults()
	eng, err := New(cfg, Options{Store: NewMemoryStore(1 << 20), Next: panicTransport{}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	req, _ := http.NewRequest(http.MethodGet, "http://example.test/", nil)
	_, err = eng.RoundTrip(req)
	if err == nil || !strings.Contains(err.Error(), "internal error in flight") {
		t.Fatalf("err = %v", err)
	}
}

func TestFlightTimeout(t *testing.T) {
	hang := make(chan struct{})
	defer close(hang)
	f := newFixture(t, Config{TTL: time.Minute, FlightTimeout: 100 * time.Millisecond}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-hang:
		case <-r.Context().Done():
		}
	}))
	r := f.get("/slow")
	var te interface{ Timeout() bool }
	if r.err == nil || !asTimeout(r.err, &te) {
		t.Fatalf("want a timeout error, got %+v", r)
	}
}

func asTimeout(err error, te *interface{ Timeout() bool }) bool {
	for err != nil {
		if t, ok := err.(interface{ Timeout() bool }); ok && t.Timeout() {
			*te = t
			return true
		}
		u, ok := err.(interface{ Unwrap() error })
		if !ok {
			return false
		}
		err = u.Unwrap()
	}
	return false
}

func TestSavingsPct(t *testing.T) {
	for _, tc := range []struct {
		saved, all uint64
		want       float64
	}{{0, 0, 0}, {1, 3, 33.3}, {2, 3, 66.7}, {499, 500, 99.8}, {5, 5, 100}} {
		if got := savingsPct(tc.saved, tc.all); got != tc.want {
			t.Errorf("savingsPct(%d,%d) = %v, want %v", tc.saved, tc.all, got, tc.want)
		}
	}
}

// TestMaxFlights: fetches that would exceed max_flights are refused with
// 503 instead of piling up.
func TestMaxFlights(t *testing.T) {
	release := make(chan struct{})
	f := newFixture(t, Config{TTL: time.Minute, MaxFlights: 2, MaxFlightsPerClient: 2}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-release
		okHandler(w, r)
	}))
	res := make(chan result, 2)
	for i := range 2 {
		go func() { res <- f.get(fmt.Sprintf("/f%d", i)) }()
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.Stats().Flights == 2 }, "two flights")
	r := f.get("/f3")
	var hs interface{ HTTPStatus() int }
	if r.err == nil || !errorsAs(r.err, &hs) || hs.HTTPStatus() != 503 {
		t.Fatalf("third flight: %+v", r)
	}
	close(release)
	for range 2 {
		if r := <-res; r.status != 200 {
			t.Fatalf("running flight: %+v", r)
		}
	}
	if r := f.get("/f3"); r.status != 200 {
		t.Fatalf("after the others finished: %+v", r)
	}
}

func errorsAs(err error, target any) bool { return errors.As(err, target) }

// TestMaxFlightsPerClient: one client cannot take every flight slot.
func TestMaxFlightsPerClient(t *testing.T) {
	release := make(chan struct{})
	f := newFixture(t, Config{TTL: time.Minute, MaxFlights: 10, MaxFlightsPerClient: 2}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-release
		okHandler(w, r)
	}))
	as := func(client string) context.Context {
		return clientinfo.With(context.Background(), clientinfo.Info{Client: client})
	}
	res := make(chan result, 3)
	for i := range 2 {
		go func() { res <- f.do(as("ip:10.0.0.1"), http.MethodGet, fmt.Sprintf("/a%d", i), nil, "") }()
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.Stats().Flights == 2 }, "two flights")
	if r := f.do(as("ip:10.0.0.1"), http.MethodGet, "/a3", nil, ""); r.err == nil || !strings.Contains(r.err.Error(), "this client") {
		t.Fatalf("third flight of one client: %+v", r)
	}
	go func() { res <- f.do(as("ip:10.0.0.2"), http.MethodGet, "/b", nil, "") }()
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.Stats().Flights == 3 }, "three flights")
	close(release)
	for range 3 {
		if r := <-res; r.status != 200 {
			t.Fatalf("%+v", r)
		}
	}
}

// goroutineID is the calling goroutine's number, from the first line of
// its stack trace ("goroutine 42 [running]:"): a test asks which goroutine
// did what, something the runtime offers no other way.
func goroutineID() int64 {
	var buf [64]byte
	line := buf[:runtime.Stack(buf[:], false)]
	line, _ = bytes.CutPrefix(line, []byte("goroutine "))
	id, _, _ := bytes.Cut(line, []byte(" "))
	n, err := strconv.ParseInt(string(id), 10, 64)
	if err != nil {
		panic("goroutineID: " + err.Error())
	}
	return n
}
