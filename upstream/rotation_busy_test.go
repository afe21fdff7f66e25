package upstream_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestRotationRetiresBusyConnections: many gateways route only new
// connections through a rotated session's new exit IP and leave open
// tunnels where they were. A connection busy when the session rotates must
// then take no new request, during its last one (HTTP/2 streams) or after
// it (an HTTP/1.1 connection back in the idle pool): every request sent
// after the rotation leaves from the new IP.
func TestRotationRetiresBusyConnections(t *testing.T) {
	bothWays(t, func(t *testing.T, c client) {
		for _, h2 := range []bool{false, true} {
			t.Run(fmt.Sprintf("h2=%v", h2), func(t *testing.T) {
				fp := fakeprovider.Start(t, fakeprovider.Options{KeepTunnels: true})
				started := make(chan struct{}, 1)
				release := make(chan struct{})
				o := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					ip, _, _ := net.SplitHostPort(r.RemoteAddr)
					if r.URL.Path == "/slow" {
						w.WriteHeader(http.StatusOK)
						w.(http.Flusher).Flush()
						started <- struct{}{}
						<-release
					}
					io.WriteString(w, ip)
				}))
				o.EnableHTTP2 = h2
				var mu sync.Mutex
				open := map[string]int{} // origin connections by source IP
				o.Config.ConnState = func(c net.Conn, st http.ConnState) {
					ip, _, _ := net.SplitHostPort(c.RemoteAddr().String())
					mu.Lock()
					defer mu.Unlock()
					switch st {
					case http.StateNew:
						open[ip]++
					case http.StateClosed, http.StateHijacked:
						open[ip]--
					}
				}
				o.StartTLS()
				t.Cleanup(o.Close)
				t.Cleanup(func() {
					select {
					case <-release:
					default:
						close(release)
					}
				})
				cfg := providerConfig(fp)
				cfg.CAFiles = []string{originCAFile(t, o)}
				logger, _ := testLogger(t)
				p := newPool(t, cfg, logger)
				ctx, cancel := context.WithCancel(t.Context())
				done := make(chan error, 1)
				go func() { done <- p.Run(ctx) }()
				t.Cleanup(func() { cancel(); <-done })
				hint := clientinfo.Info{Account: "acme", Session: "busy"}

				first := c.mustGet(t, p, o.URL+"/a", hint)
				id := first.upstream
				slow := make(chan error, 1)
				go func() {
					r, err := c.send(t, p, http.MethodGet, o.URL+"/slow", hint, "")
					if err == nil && r.body != first.body {
						err = fmt.Errorf("the slow request left from %s, not %s", r.body, first.body)
					}
					slow <- err
				}()
				<-started
				if err := p.Rotate(t.Context(), id); err != nil {
					t.Fatal(err)
				}
				now := exitIP(t, fp, id)
				if now == first.body {
					t.Fatalf("the provider kept exit IP %s", now)
				}
				if r := c.mustGet(t, p, o.URL+"/during", hint); r.body != now {
					t.Errorf("a request during the old connection's last one left from %s, want the new exit IP %s", r.body, now)
				}
				close(release)
				if err := <-slow; err != nil {
					t.Fatal(err)
				}
				for i := range 3 {
					if r := c.mustGet(t, p, o.URL+"/after", hint); r.body != now {
						t.Errorf("request %d after the rotation left from %s, want the new exit IP %s", i, r.body, now)
					}
				}
				testkit.Eventually(t, testkit.Patience, func() bool {
					mu.Lock()
					defer mu.Unlock()
					return open[first.body] == 0
				}, "the old exit IP's connection to close")
			})
		}
	})
}

// TestRotateHonoursTheAPIsRetryAfter: a rotation the provider API refused
// with 429 and Retry-After is not asked for again before then. The
// session's backoff after a failed rotation was 10s whatever the API
// said: a 429 from another site on the same exit IP 11s later called the
// rate-limited API again.
func TestRotateHonoursTheAPIsRetryAfter(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 1})
	a, b := newOrigin(t, false), newOrigin(t, false)
	ip := exitIP(t, fp, "s1")
	a.rateLimit(ip, time.Second)
	b.rateLimit(ip, time.Second)
	logger, _ := testLogger(t)
	p := newPool(t, providerConfig(fp), logger)
	start := time.Now()
	var now atomic.Int64
	now.Store(start.UnixNano())
	upstream.SetClock(p, func() time.Time { return time.Unix(0, now.Load()) })
	fp.SetAPIMode(fakeprovider.API429)
	before := fp.APICalls()
	if r := mustGet(t, p, a.URL, clientinfo.Info{}); r.status != http.StatusTooManyRequests {
		t.Fatalf("first site: %+v, want its 429", r)
	}
	if fp.APICalls() != before+1 {
		t.Fatalf("%d rotate calls after the first 429, want 1", fp.APICalls()-before)
	}
	now.Store(start.Add(11 * time.Second).UnixNano())
	if r := mustGet(t, p, b.URL, clientinfo.Info{}); r.status != http.StatusTooManyRequests {
		t.Fatalf("second site: %+v, want its 429", r)
	}
	if n := fp.APICalls() - before; n != 1 {
		t.Errorf("%d rotate calls within 11s of the API's 429 with Retry-After: 30, want 1", n)
	}
}
