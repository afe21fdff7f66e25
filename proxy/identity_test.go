package proxy_test

import (
	"crypto/x509"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/ratelimit"
)

// TestOneClientIdentity: the rate limit and the dedup per-client flight
// cap count the same client. Behind a trusted balancer (127.0.0.1 adding
// X-Forwarded-For) two clients are two clients for both; inside a tunnel
// the client is the one its CONNECT came from, whatever the decrypted
// requests claim in their own X-Forwarded-For.
func TestOneClientIdentity(t *testing.T) {
	var release *testkit.Gate
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" && !release.Wait(r.Context()) {
			return
		}
		echoProto(w, r)
	})
	plain := plainOrigin(t, handler)
	tlsO := tlsOrigin(t, handler, false)
	w := newWorld(t, worldOpts{
		proxy:     proxy.Config{TrustForwardedFor: true},
		originCAs: []*x509.Certificate{tlsO.Certificate()},
		dedup:     dedupOn(dedup.Config{MaxFlights: 8, MaxFlightsPerClient: 1}),
		rateLimit: &ratelimit.Config{Requests: 3, Window: time.Minute},
	})
	release = testkit.NewGate(t)
	c := w.client(false)
	get := func(u, forwardedFor string) int {
		t.Helper()
		resp, _ := w.get(c, u, "X-Forwarded-For", forwardedFor)
		return resp.StatusCode
	}

	// Client A leads a flight that hangs: its one flight slot is taken.
	slow := make(chan error, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodGet, plain.URL+"/slow", nil)
		req.Header.Set("X-Forwarded-For", "203.0.113.1")
		resp, err := c.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode != 200 {
				err = fmt.Errorf("status %d", resp.StatusCode)
			}
		}
		slow <- err
	}()
	testkit.Eventually(t, testkit.Patience, func() bool { return w.engine.Stats().Flights == 1 }, "A's flight to start")
	// B is another client: its flight has its own slot.
	if st := get(plain.URL+"/b", "203.0.113.2"); st != 200 {
		t.Errorf("client B while A's flight hangs: %d, want 200 (B is not A)", st)
	}
	// A's second flight is over A's cap.
	if st := get(plain.URL+"/a2", "203.0.113.1"); st != 503 {
		t.Errorf("A's second flight: %d, want 503 (one flight per client)", st)
	}
	release.Open()
	if err := <-slow; err != nil {
		t.Fatalf("A's slow request: %v", err)
	}

	// Inside a tunnel the CONNECT's client is counted: three requests
	// allowed, the fourth refused, whatever each claims to come from.
	for i := range 4 {
		want := 200
		if i == 3 {
			want = 429
		}
		if st := get(fmt.Sprintf("%s/t%d", tlsO.URL, i), fmt.Sprintf("198.51.100.%d", i+1)); st != want {
			t.Fatalf("request %d inside the tunnel: %d, want %d", i+1, st, want)
		}
	}
}
