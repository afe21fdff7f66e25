package proxy_test

import (
	"context"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestOriginStalledMidBody: an origin that sends part of a body and then
// nothing more is given up after what config.yaml promises, for HTTP/1.1
// and HTTP/2 clients alike, whatever their own idle timeout (an hour
// here): a flight's body after dedup.stall_timeout (no byte for that
// long fails it for every reader), a body passed through (a POST) after
// upstream.idle_timeout (its origin connection closes). Each is 1s here
// and the others an hour, so that an answer at all within the test's
// minute shows which one acted. A body whose head has gone out ends cut
// short (HTTP/1.1: the connection closes before its Content-Length;
// HTTP/2: RST_STREAM); a small one a flight reads whole before answering
// (up to 64 KiB) gets a 504 instead, with the reason. That one was held
// until flight_timeout, which covers the headers only.
func TestOriginStalledMidBody(t *testing.T) {
	stop := make(chan struct{})
	origin := tlsOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/trickle" { // a byte every 100 ms while the test runs
			for {
				w.Write([]byte("x"))
				w.(http.Flusher).Flush()
				select {
				case <-stop:
					return
				case <-r.Context().Done():
					return
				case <-time.After(100 * time.Millisecond):
				}
			}
		}
		size, _ := strconv.Atoi(r.URL.Query().Get("size"))
		w.Header().Set("Content-Length", strconv.Itoa(size))
		w.Write([]byte(strings.Repeat("x", size/2)))
		w.(http.Flusher).Flush()
		select { // the rest never comes
		case <-stop:
		case <-r.Context().Done():
		}
	}), false)
	t.Cleanup(func() { close(stop) })
	const long = time.Hour
	flights := newWorld(t, worldOpts{
		proxy:     proxy.Config{IdleTimeout: long},
		upstream:  upstream.Config{IdleTimeout: long},
		originCAs: []*x509.Certificate{origin.Certificate()},
		dedup:     dedupOn(dedup.Config{StallTimeout: time.Second, FlightTimeout: long}),
	})
	passed := newWorld(t, worldOpts{
		proxy:     proxy.Config{IdleTimeout: long},
		upstream:  upstream.Config{IdleTimeout: time.Second},
		originCAs: []*x509.Certificate{origin.Certificate()},
		dedup:     dedupOn(dedup.Config{StallTimeout: long, FlightTimeout: long}),
	})
	// The same with the origin's HTTP/2 connection kept busy by another
	// stream (mirrored for an HTTP/2 client; through net/http, which
	// speaks HTTP/2 to the origin whatever the client spoke): the
	// connection's idle timeout never fires, the stalled stream's must.
	busy := newWorld(t, worldOpts{
		proxy:     proxy.Config{IdleTimeout: long},
		upstream:  upstream.Config{IdleTimeout: time.Second, Fingerprint: upstream.FingerprintGo},
		originCAs: []*x509.Certificate{origin.Certificate()},
		dedup:     dedupOn(dedup.Config{StallTimeout: long, FlightTimeout: long}),
	})
	// And the client's own idle timeout, when it is the shortest: nothing
	// moves on an HTTP/1.1 client's connection meanwhile, nor on an
	// HTTP/2 client's stream, whose write deadline (proxy.idle_timeout,
	// moved by each write) runs on while the origin stalls, however busy
	// the connection's other streams keep it.
	clientIdle := newWorld(t, worldOpts{
		proxy:     proxy.Config{IdleTimeout: time.Second},
		upstream:  upstream.Config{IdleTimeout: long},
		originCAs: []*x509.Certificate{origin.Certificate()},
		dedup:     dedupOn(dedup.Config{StallTimeout: long, FlightTimeout: long}),
	})
	for _, tc := range []struct {
		name    string
		w       *world
		method  string
		size    int
		want    string // the status; a 200 must end in a body error
		trickle bool   // another stream keeps the origin connection busy
	}{
		{"flight small body", flights, http.MethodGet, 2000, "504", false},
		{"flight streamed body", flights, http.MethodGet, 200000, "200", false},
		{"passed through", passed, http.MethodPost, 200000, "200", false},
		{"passed through, busy connection", passed, http.MethodPost, 200000, "200", true},
		{"passed through net/http, busy connection", busy, http.MethodPost, 200000, "200", true},
		{"client idle timeout, busy connection", clientIdle, http.MethodPost, 200000, "200", true},
	} {
		for _, h2 := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/h2=%v", tc.name, h2), func(t *testing.T) {
				if tc.trickle && tc.w == passed && !h2 {
					t.Skip("an HTTP/1.1 client's mirrored origin connection is HTTP/1.1")
				}
				c := tc.w.client(h2)
				if tc.trickle {
					go func() {
						resp, err := c.Post(origin.URL+"/trickle", "text/plain", strings.NewReader("b"))
						if err == nil {
							io.Copy(io.Discard, resp.Body)
							resp.Body.Close()
						}
					}()
					time.Sleep(200 * time.Millisecond) // its stream first, on the connection the next one takes
				}
				// An answer after the test's half minute is one no 1s
				// timeout gave.
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				u := fmt.Sprintf("%s/stall-%v?size=%d", origin.URL, h2, tc.size)
				req, _ := http.NewRequestWithContext(ctx, tc.method, u, strings.NewReader("b"))
				resp, err := c.Do(req)
				if err != nil {
					t.Fatalf("%s: %v (the stall was not given up)", tc.method, err)
				}
				defer resp.Body.Close()
				n, err := io.Copy(io.Discard, resp.Body)
				if ctx.Err() != nil {
					t.Fatalf("the body was still held after 30s: %d bytes, %v", n, err)
				}
				if got := strconv.Itoa(resp.StatusCode); got != tc.want {
					t.Fatalf("status %s (%s), want %s", got, resp.Header.Get("X-Onceproxy-Error"), tc.want)
				}
				if resp.ProtoMajor != map[bool]int{false: 1, true: 2}[h2] {
					t.Errorf("client spoke %s", resp.Proto)
				}
				if tc.want == "200" && (err == nil || n >= int64(tc.size)) {
					t.Errorf("body: %d of %d bytes, err %v; want it cut short with an error", n, tc.size, err)
				}
				if tc.want == "504" && resp.Header.Get("X-Onceproxy-Error") != "upstream_timeout" {
					t.Errorf("X-Onceproxy-Error %q, want upstream_timeout", resp.Header.Get("X-Onceproxy-Error"))
				}
			})
		}
	}
}
