package proxy_test

import (
	"crypto/x509"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestNoContentTypeAdded: a response the origin sends without a
// Content-Type reaches the client without one, over every path (the lean
// HTTP/1.1 loop, net/http's HTTP/1.1 and HTTP/2 servers, plain http and
// https, miss and hit): net/http would otherwise sniff the body and add
// one, which the origin never sent.
func TestNoContentTypeAdded(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()["Content-Type"] = nil // the origin's server must not sniff either
		io.WriteString(w, "<html><body>no type</body></html>")
	})
	tlsO := tlsOrigin(t, h, false)
	plainO := plainOrigin(t, h)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{tlsO.Certificate()}, dedup: dedupOn(dedup.Config{})})
	for _, tc := range []struct {
		name, method, url string
		h2                bool
	}{
		{"https h1 GET", http.MethodGet, tlsO.URL + "/a", false},
		{"https h2 GET", http.MethodGet, tlsO.URL + "/b", true},
		{"https h1 POST", http.MethodPost, tlsO.URL + "/c", false},
		{"https h2 POST", http.MethodPost, tlsO.URL + "/d", true},
		{"http GET", http.MethodGet, plainO.URL + "/e", false},
		{"http POST", http.MethodPost, plainO.URL + "/f", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := w.client(tc.h2)
			for round := range 2 { // the miss, then the hit where there is one
				var send io.Reader // a GET without a body takes the lean loop where it can
				if tc.method == http.MethodPost {
					send = strings.NewReader("x")
				}
				req, err := http.NewRequest(tc.method, tc.url, send)
				if err != nil {
					t.Fatal(err)
				}
				resp, err := c.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "no type") {
					t.Fatalf("round %d: %d %q", round, resp.StatusCode, body)
				}
				if ct, ok := resp.Header["Content-Type"]; ok {
					t.Errorf("round %d (%s, X-Cache %s): Content-Type %q added: %v", round, resp.Proto, resp.Header.Get("X-Cache"), ct, resp.Header)
				}
			}
		})
	}
}
