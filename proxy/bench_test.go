package proxy_test

import (
	"crypto/x509"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// BenchmarkMITMRequest measures one GET through the proxy's MITM on a
// kept-alive client connection to a loopback HTTPS origin (the miss path,
// dedup off): the proxy's per-request cost plus two loopback round trips.
// fingerprint=mirror (the default) goes out with the client's own
// fingerprint over the mirrored pool; fingerprint=go is net/http's
// transport, the way every request went before mirroring.
func BenchmarkMITMRequest(b *testing.B) {
	for _, tc := range []struct {
		name        string
		h2          bool
		fingerprint string
	}{
		{"h1/fingerprint=mirror", false, upstream.FingerprintMirror},
		{"h1/fingerprint=go", false, upstream.FingerprintGo},
		{"h2/fingerprint=mirror", true, upstream.FingerprintMirror},
		{"h2/fingerprint=go", true, upstream.FingerprintGo},
	} {
		b.Run(tc.name, func(b *testing.B) {
			origin := tlsOrigin(b, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Write(make([]byte, 2048))
			}), false)
			w := newWorld(b, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, quiet: true,
				upstream: upstream.Config{Fingerprint: tc.fingerprint}})
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
// the whole proxy path of a HIT, without the origin (the fingerprint tap
// on the client connection included).
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
