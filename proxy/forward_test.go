package proxy_test

import (
	"crypto/x509"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestTrailersReachTheClient: an origin's trailers, announced before the
// body and added after it, reach the client through the proxy port and
// through intercepted tunnels over HTTP/1.1 and HTTP/2, as goproxy's own
// copy forwarded them before requests took the forward path.
func TestTrailersReachTheClient(t *testing.T) {
	h := http.HandlerFunc(sendTrailers)
	tlsO := tlsOrigin(t, h, false)
	// Shipped defaults, dedup on: a POST still streams the origin's answer.
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{tlsO.Certificate()}, dedup: dedupOn(dedup.Config{})})
	origins := map[string]string{"https": tlsO.URL, "http": plainOrigin(t, h).URL}
	for _, c := range []struct {
		name, origin string
		h2           bool
	}{{"http", "http", false}, {"https-h1", "https", false}, {"https-h2", "https", true}} {
		for _, late := range []bool{false, true} {
			u := origins[c.origin] + "/t"
			name, value := "X-Sum", "42"
			if late {
				u += "?late=1"
				name, value = "X-Late", "7"
			}
			// POST: not deduplicated, so the origin's own response streams.
			resp, err := w.client(c.h2).Post(u, "text/plain", strings.NewReader("x"))
			if err != nil {
				t.Fatalf("%s: %v", c.name, err)
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || string(b) != "body" {
				t.Fatalf("%s: body %q, %v", c.name, b, err)
			}
			if got := resp.Trailer.Get(name); got != value {
				t.Errorf("%s (late %v): trailer %s = %q, want %q (trailers %v)", c.name, late, name, got, value, resp.Trailer)
			}
		}
	}
}

// sendTrailers answers "body" with the trailer X-Sum: 42 announced, or
// with ?late=1 the trailer X-Late: 7 announced by nothing but its prefix
// (http.TrailerPrefix).
func sendTrailers(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	if r.URL.Query().Get("late") == "" {
		w.Header().Set("Trailer", "X-Sum")
	}
	io.WriteString(w, "body")
	w.(http.Flusher).Flush()
	if r.URL.Query().Get("late") == "" {
		w.Header().Set("X-Sum", "42")
	} else {
		w.Header().Set(http.TrailerPrefix+"X-Late", "7")
	}
}
