package app

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/metrics"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// countingPool is the real pool, with every read that walks its sessions
// counted.
type countingPool struct {
	*upstream.Pool
	walks atomic.Int64
}

func (c *countingPool) Snapshot() upstream.Snapshot {
	c.walks.Add(1)
	return c.Pool.Snapshot()
}

// TestScrapeWalksSessionsOnce: a scrape read the upstream sessions once per
// metric that shows them (Providers six times, under the pool's lock, the
// lock a provider refresh and a request's "no sessions yet" answer take),
// so a scrape storm multiplied every hold. One scrape is one read now.
func TestScrapeWalksSessionsOnce(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 3})
	a := serveApp(t, "", []string{"ONCEPROXY_UPSTREAM_PROVIDER_API=" + fp.APIURL(), "ONCEPROXY_UPSTREAM_PROVIDER_API_KEY=" + fp.APIKey()})
	cp := &countingPool{Pool: a.Upstream}
	m := metrics.New(nil)
	registerMetrics(m, a.Proxy, a.Engine, a.CA, cp, nil)
	scrapeOf := func() string {
		t.Helper()
		return scrapeHandler(t, m)
	}
	text := scrapeOf()
	if n := cp.walks.Load(); n != 1 {
		t.Errorf("one scrape walked the upstream sessions %d times, want 1", n)
	}
	// Every series the walks fed is still there, from the one read.
	for _, name := range []string{"onceproxy_upstream_session_requests_total", "onceproxy_upstream_session_failures_total",
		"onceproxy_upstream_session_weight", "onceproxy_upstream_session_available"} {
		if got := len(samples(t, text, name)); got != 3 {
			t.Errorf("%s: %d series, want 3 (one per session)", name, got)
		}
	}
	for _, name := range []string{"onceproxy_upstream_provider_available", "onceproxy_upstream_provider_sessions",
		"onceproxy_upstream_provider_ready_sessions", "onceproxy_upstream_provider_refresh_failures_total"} {
		got := samples(t, text, name)
		if len(got) != 1 {
			t.Errorf("%s: %v, want one series (provider default)", name, got)
		}
	}
	if got := samples(t, text, "onceproxy_upstream_provider_sessions")[`provider="default"`]; got != 3 {
		t.Errorf("onceproxy_upstream_provider_sessions = %v, want 3", got)
	}
	for _, name := range []string{"onceproxy_upstream_sessions_cooling_ratio", "onceproxy_upstream_site_cooldowns"} {
		if !strings.Contains(text, "\n"+name+" ") {
			t.Errorf("no %s in the scrape", name)
		}
	}
}

// BenchmarkScrape is one /metrics scrape of an instance with a provider
// of upstream.DefaultMaxSessions sessions (the most it takes from a list
// as shipped): serial, and from many scrapers at once (a scrape storm).
//
//	go test -run='^$' -bench=Scrape -benchmem ./internal/app/
func BenchmarkScrape(b *testing.B) {
	fp := fakeprovider.Start(b, fakeprovider.Options{Sessions: upstream.DefaultMaxSessions})
	a := buildFromFile(b, writeConfig(b, ""), []string{"ONCEPROXY_UPSTREAM_PROVIDER_API=" + fp.APIURL(), "ONCEPROXY_UPSTREAM_PROVIDER_API_KEY=" + fp.APIKey()})
	h := a.Metrics.Handler()
	if got := len(samples(b, scrapeHandler(b, a.Metrics), "onceproxy_upstream_session_weight")); got != upstream.DefaultMaxSessions {
		b.Fatalf("%d sessions in the scrape, want %d", got, upstream.DefaultMaxSessions)
	}
	b.Run("serial", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		}
	})
	// Scrapers at once: as many as MaxScrapes (none refused), and four
	// times as many (a storm: the rest are refused at once).
	for _, scrapers := range []int{metrics.MaxScrapes, 4 * metrics.MaxScrapes} {
		b.Run(fmt.Sprintf("scrapers=%d", scrapers), func(b *testing.B) {
			b.ReportAllocs()
			b.SetParallelism(max(1, scrapers/runtime.GOMAXPROCS(0)))
			var refused atomic.Int64
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					rec := httptest.NewRecorder()
					h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
					if rec.Code != http.StatusOK {
						refused.Add(1)
					}
				}
			})
			b.ReportMetric(float64(refused.Load())/float64(b.N), "refused/op")
		})
	}
}
