package upstream_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
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
