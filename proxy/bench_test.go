package proxy_test

import (
	"crypto/x509"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// BenchmarkMITMRequest measures one GET through the proxy's MITM on a
// kept-alive client connection to a loopback HTTPS origin: the proxy's
// per-request cost plus two loopback round trips.
func BenchmarkMITMRequest(b *testing.B) {
	for _, tc := range []struct {
		name string
		h2   bool
	}{{"h1", false}, {"h2", true}} {
		b.Run(tc.name, func(b *testing.B) {
			origin := tlsOrigin(b, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Write(make([]byte, 2048))
			}), false)
			w := newWorld(b, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, quiet: true})
			c := w.client(tc.h2)
			url := origin.URL + "/bench"
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				resp, err := c.Get(url)
				if err != nil {
					b.Fatal(err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					b.Fatalf("status %d", resp.StatusCode)
				}
			}
		})
	}
}

// BenchmarkMITMHit is BenchmarkMITMRequest answered from the dedup cache:
// the whole proxy path of a HIT, without the origin.
func BenchmarkMITMHit(b *testing.B) {
	origin := tlsOrigin(b, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write(make([]byte, 2048))
	}), false)
	w := newWorld(b, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, quiet: true, dedup: dedupOn(dedup.Config{TTL: time.Hour})})
	c := w.client(false)
	url := origin.URL + "/hit"
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		resp, err := c.Get(url)
		if err != nil {
			b.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	if st := w.engine.Stats(); st.UpstreamRequests != 1 {
		b.Fatalf("upstream requests %d", st.UpstreamRequests)
	}
}
