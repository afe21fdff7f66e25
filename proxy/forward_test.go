package proxy_test

import (
	"crypto/x509"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
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

// TestForbiddenTrailersStayBehind: fields that must never be trailers
// (RFC 9110 §6.5.1: framing, routing, authentication…) are not handed on
// when an origin sends them anyway, announced or not, as net/http's
// server drops them; the others reach the client, when the answer is
// passed through (an answer shared by a flight keeps no trailer).
func TestForbiddenTrailersStayBehind(t *testing.T) {
	origin := testkit.RawHTTP(t, "HTTP/1.1 200 OK\r\nTrailer: X-Sum\r\nTransfer-Encoding: chunked\r\n\r\n"+
		"4\r\nbody\r\n0\r\nX-Sum: 42\r\nContent-Length: 99\r\nHost: elsewhere\r\nContent-Encoding: gzip\r\nX-Late: 7\r\n\r\n")
	for _, d := range []*dedup.Config{nil, dedupOn(dedup.Config{})} {
		w := newWorld(t, worldOpts{dedup: d})
		for _, method := range []string{http.MethodGet, http.MethodPost} {
			// No body: the raw origin reads none, and unread bytes would
			// make its close a reset. A POST goes through net/http anyway.
			req, _ := http.NewRequest(method, "http://"+origin+"/t", http.NoBody)
			resp, err := w.client(false).Do(req)
			if err != nil {
				t.Fatalf("%s (dedup %v): %v", method, d != nil, err)
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || string(b) != "body" {
				t.Fatalf("%s (dedup %v): body %q, %v", method, d != nil, b, err)
			}
			shared := d != nil && method == http.MethodGet
			if !shared && (resp.Trailer.Get("X-Sum") != "42" || resp.Trailer.Get("X-Late") != "7") {
				t.Errorf("%s (dedup %v): trailers %v, want X-Sum and X-Late", method, d != nil, resp.Trailer)
			}
			for _, k := range []string{"Content-Length", "Host", "Content-Encoding"} {
				if _, ok := resp.Trailer[k]; ok {
					t.Errorf("%s (dedup %v): trailer %s handed on (%v)", method, d != nil, k, resp.Trailer)
				}
			}
		}
	}
}
