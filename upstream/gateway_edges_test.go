package upstream_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestConnectHandshakeHonoursDialTimeout: dial_timeout bounds "one TCP
// connect ... including the CONNECT / SOCKS5 handshake". A tunnel asked
// for with a context that allows longer (the proxy's blind-tunnel dial, a
// client's deadline) still gives up on a gateway that accepts and says
// nothing after dial_timeout, charges that session and tries the next
// one. HTTP CONNECT once used the caller's deadline instead: the hanging
// gateway ate the whole budget, the error was taken for the caller's own
// give-up and the session was never charged.
func TestConnectHandshakeHonoursDialTimeout(t *testing.T) {
	for _, scheme := range []string{"socks5", "http"} {
		t.Run(scheme, func(t *testing.T) {
			fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
			o := newOrigin(t, false)
			fp.SetMode("s1", fakeprovider.ModeHang)
			logger, _ := testLogger(t)
			p := newPool(t, upstream.Config{
				DialTimeout: 300 * time.Millisecond,
				Sessions: []upstream.SessionConfig{
					{ID: "a", URL: fp.URL("s1", scheme)},
					{ID: "b", URL: fp.URL("s2", scheme)},
				},
			}, logger)
			ctx, cancel := context.WithTimeout(clientinfo.With(context.Background(), clientinfo.Info{Session: "a"}), 4*time.Second)
			defer cancel()
			start := time.Now()
			c, err := p.DialContext(ctx, "tcp", strings.TrimPrefix(o.URL, "http://"))
			took := time.Since(start)
			fp.SetMode("s1", fakeprovider.ModeOK) // release the hung handler
			if err != nil {
				t.Fatalf("tunnel failed after %v: %v (want the hanging session a given up after dial_timeout and b used)", took, err)
			}
			c.Close()
			if took > 2*time.Second {
				t.Errorf("tunnel took %v: the CONNECT handshake was not bounded by dial_timeout (300ms)", took)
			}
			if st := statusOf(t, p, "a"); st.Available {
				t.Errorf("session a hung its handshake but is not cooling down: %+v", st)
			}
		})
	}
}

// TestGateway429RetryAfter: a gateway that rate-limits a session says for
// how long (Retry-After), and the session is benched that long whether
// the 429 answered an absolute-form request (plain http) or a CONNECT
// (https, tunnels), which once lost the header and benched it for the
// default 60s only.
//
// On plain http the gateway says the 429 is its own with Proxy-Status
// (RFC 9209): without that, a 429 is the origin's, and benches the
// session at the origin's site alone (TestSiteRateLimitSitsOutThatSite).
func TestGateway429RetryAfter(t *testing.T) {
	gw := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", "600")
		w.Header().Set("Proxy-Status", "gw; error=http_request_denied")
		http.Error(w, "session rate limited", http.StatusTooManyRequests)
	}))
	t.Cleanup(gw.Close)
	for _, scheme := range []string{"http", "https"} {
		t.Run(scheme, func(t *testing.T) {
			logger, _ := testLogger(t)
			p := newPool(t, upstream.Config{URL: "http://u:pw-123@" + gw.Listener.Addr().String()}, logger)
			now := time.Now()
			upstream.SetClock(p, func() time.Time { return now })
			send(t, p, http.MethodGet, scheme+"://127.0.0.1:9/", clientinfo.Info{}, "")
			st := statusOf(t, p, "default")
			if st.Available {
				t.Fatalf("session not cooling after the gateway's 429: %+v", st)
			}
			if got := st.CooldownUntil.Sub(now); got < 590*time.Second {
				t.Errorf("cooldown %v after a gateway 429 with Retry-After: 600", got)
			}
		})
	}
}
