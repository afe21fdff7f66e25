package proxy_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/netguard"
	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// metricLine returns the world's metrics line that starts with name.
func (w *world) metricLine(name string) string {
	rec := httptest.NewRecorder()
	w.app.Metrics.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	b, _ := io.ReadAll(rec.Body)
	for line := range strings.Lines(string(b)) {
		if strings.HasPrefix(line, name+" ") {
			return strings.TrimSpace(line)
		}
	}
	return ""
}

// TestSOCKS5DialTimeRefusalIsCounted: a name that passes the early check
// but resolves to a forbidden address (DNS rebinding) is refused at dial
// time with reply 0x02, and counted in onceproxy_ssrf_refused_total like
// the same refusal of a request or of a bypass CONNECT on the HTTP port.
func TestSOCKS5DialTimeRefusalIsCounted(t *testing.T) {
	lookup := func(context.Context, string, string) ([]netip.Addr, error) {
		return []netip.Addr{netip.MustParseAddr("127.0.0.1")}, nil
	}
	w := newWorld(t, worldOpts{
		upstreamOpts: []upstream.Option{upstream.WithLookup(lookup)},
		guard:        &netguard.Config{},
		socks5:       socksOn(socks.Config{AllowNoAuth: true}),
	})
	r := dialRaw(t, w)
	r.greet(0)
	if got := r.request(1, "rebind.test", 9999); got != 2 {
		t.Fatalf("reply %d, want 2 (connection not allowed by ruleset)", got)
	}
	r.expectClosed()
	if got := w.metricLine("onceproxy_ssrf_refused_total"); got != "onceproxy_ssrf_refused_total 1" {
		t.Fatalf("metrics: %q, want the refusal counted once", got)
	}
}
