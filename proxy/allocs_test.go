package proxy_test

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strconv"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/app"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// allocBudgetFile holds the committed allocations per request of each
// path, for builds with and without the race detector (which allocates
// on its own, and makes sync.Pool drop items at random).
const allocBudgetFile = "testdata/alloc_budget.json"

// allocGrowth is how far a path may grow over its budget before
// TestAllocationBudget fails.
const allocGrowth = 1.20

// An allocPath is one way a request goes through the proxy, with the
// shipped configuration (dedup, keys, metrics and the access log on, the
// client's fingerprint mirrored upstream).
type allocPath struct {
	name string
	tls  bool // https through a CONNECT tunnel (MITM); else plain http
	h2   bool // the client speaks HTTP/2 in the tunnel
	hit  bool // every request the same URL, answered from the cache; else every URL new
}

var allocPaths = []allocPath{
	{name: "miss/https-h1", tls: true},
	{name: "miss/https-h2", tls: true, h2: true},
	{name: "miss/http", tls: false},
	{name: "hit/https-h1", tls: true, hit: true},
	{name: "hit/https-h2", tls: true, h2: true, hit: true},
	{name: "hit/http", tls: false, hit: true},
}

// allocBench is a path's proxy, origin and clients, ready for requests.
type allocBench struct {
	path    allocPath
	proxied *http.Client
	direct  *http.Client
	base    string
	n       int
}

func newAllocBench(tb testing.TB, p allocPath) *allocBench {
	tb.Helper()
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		w.Write(make([]byte, 2048))
	})
	var origin *httptest.Server
	var cas []*x509.Certificate
	if p.tls {
		origin = tlsOrigin(tb, h, false)
		cas = append(cas, origin.Certificate())
	} else {
		origin = plainOrigin(tb, h)
	}
	cfg, err := app.LoadConfig(shippedConfig, "", nil)
	if err != nil {
		tb.Fatal(err)
	}
	w := newWorld(tb, worldOpts{originCAs: cas, quiet: true, dedup: &cfg.Dedup})
	direct := &http.Transport{ForceAttemptHTTP2: p.h2, DisableCompression: true}
	if p.tls {
		pool := x509.NewCertPool()
		pool.AddCert(origin.Certificate())
		direct.TLSClientConfig = &tls.Config{RootCAs: pool}
		if !p.h2 {
			direct.TLSClientConfig.NextProtos = []string{"http/1.1"}
			direct.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
		}
	}
	tb.Cleanup(direct.CloseIdleConnections)
	return &allocBench{path: p, proxied: w.client(p.h2), direct: &http.Client{Transport: direct}, base: origin.URL}
}

// do sends one request with c and reads its answer.
func (a *allocBench) do(tb testing.TB, c *http.Client) {
	u := a.base + "/hot"
	if !a.path.hit {
		a.n++
		u = a.base + "/item/" + strconv.Itoa(a.n)
	}
	resp, err := c.Get(u)
	if err != nil {
		tb.Fatal(err)
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK {
		tb.Fatalf("GET %s: %d, %v", u, resp.StatusCode, err)
	}
	if c == a.proxied {
		want := dedup.CacheMiss
		if a.path.hit {
			want = dedup.CacheHit
		}
		if xc := resp.Header.Get("X-Cache"); xc != want {
			tb.Fatalf("GET %s: X-Cache %q, want %q", u, xc, want)
		}
	}
}

// fill sends the MISS that fills the cache for the hit paths.
func (a *allocBench) fill(tb testing.TB) {
	resp, err := a.proxied.Get(a.base + "/hot")
	if err != nil {
		tb.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
}

// allocsPerRequest is the process's allocations per request over n
// requests sent with c, after a warm-up.
func (a *allocBench) allocsPerRequest(tb testing.TB, c *http.Client, n int) float64 {
	for range 20 {
		a.do(tb, c)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range n {
		a.do(tb, c)
	}
	runtime.ReadMemStats(&after)
	return float64(after.Mallocs-before.Mallocs) / float64(n)
}

// proxyAllocs is what the proxy adds per request: the allocations of
// requests through it, less those of the same requests sent straight to
// the origin (the client's and the origin's own).
func (a *allocBench) proxyAllocs(tb testing.TB, n int) float64 {
	if a.path.hit {
		a.fill(tb)
	}
	direct := a.allocsPerRequest(tb, a.direct, n)
	proxied := a.allocsPerRequest(tb, a.proxied, n)
	return proxied - direct
}

type allocBudget map[string]map[string]float64 // build ("race", "norace") → path → allocs

func buildMode() string {
	if raceEnabled {
		return "race"
	}
	return "norace"
}

// TestAllocationBudget fails when a path allocates more than 20 % over its
// committed budget per request. ALLOC_BUDGET_UPDATE=1 writes what this
// build measures as the new budget.
func TestAllocationBudget(t *testing.T) {
	raw, err := os.ReadFile(allocBudgetFile)
	if err != nil {
		t.Fatal(err)
	}
	var budget allocBudget
	if err := json.Unmarshal(raw, &budget); err != nil {
		t.Fatalf("%s: %v", allocBudgetFile, err)
	}
	mode := buildMode()
	measured := map[string]float64{}
	for _, p := range allocPaths {
		t.Run(p.name, func(t *testing.T) {
			got := newAllocBench(t, p).proxyAllocs(t, 300)
			measured[p.name] = math.Round(got)
			want, ok := budget[mode][p.name]
			switch {
			case os.Getenv("ALLOC_BUDGET_UPDATE") != "":
				t.Logf("%s (%s): %.1f allocations per request", p.name, mode, got)
			case !ok:
				t.Fatalf("%s has no budget for %s builds; run with ALLOC_BUDGET_UPDATE=1", allocBudgetFile, mode)
			case got > want*allocGrowth:
				t.Errorf("%.1f allocations per request, %.0f%% over the budget of %.0f (at most %.0f%% allowed): profile with go test -bench Paths -memprofile",
					got, 100*(got/want-1), want, 100*(allocGrowth-1))
			default:
				t.Logf("%.1f allocations per request (budget %.0f)", got, want)
			}
		})
	}
	if os.Getenv("ALLOC_BUDGET_UPDATE") == "" || t.Failed() {
		return
	}
	if budget == nil {
		budget = allocBudget{}
	}
	budget[mode] = measured
	out, err := json.MarshalIndent(budget, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(allocBudgetFile, append(out, '\n'), 0o644); err != nil {
		t.Fatal(err)
	}
}

// BenchmarkPaths sends requests down each path of allocPaths. allocs/op
// and B/op count the client and the origin too; proxy-allocs/op is the
// proxy's own share, as TestAllocationBudget measures it. goroutines/op
// is every goroutine started per request, the client's and the origin's
// included (net/http's server starts one per request to hear its client
// leave, and its HTTP/2 server one per stream and per frame it cannot
// buffer): each costs a stack that may grow and a wake-up.
func BenchmarkPaths(b *testing.B) {
	for _, p := range allocPaths {
		b.Run(p.name, func(b *testing.B) {
			a := newAllocBench(b, p)
			own := a.proxyAllocs(b, 200)
			b.ReportAllocs()
			b.ResetTimer()
			started := testkit.GoroutinesStarted()
			for b.Loop() {
				a.do(b, a.proxied)
			}
			// After the loop b.N is the number of requests it sent.
			b.ReportMetric(float64(testkit.GoroutinesStarted()-started)/float64(b.N), "goroutines/op")
			b.ReportMetric(own, "proxy-allocs/op")
		})
	}
}
