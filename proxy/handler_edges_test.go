package proxy_test

import (
	"bufio"
	"context"
	"crypto/x509"
	"fmt"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestWaitersKeepWaiting: clients in intercepted tunnels that wait
// on one flight longer than the lean loop's watchAfter, some on their
// connection's first request, some on a later one, all get the flight's
// answer, not an answer made up while it runs.
func TestWaitersKeepWaiting(t *testing.T) {
	const clients = 10
	release := testkit.NewGate(t)
	var hits atomic.Int64
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hot" {
			hits.Add(1)
			release.Wait(r.Context())
		}
		io.WriteString(rw, "body of "+r.URL.Path)
	}), true)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, dedup: dedupOn(dedup.Config{})})
	host := strings.TrimPrefix(origin.URL, "https://")
	type result struct {
		status int
		body   string
		err    error
	}
	res := make(chan result, clients)
	for i := range clients {
		c := insideTunnel(t, w, host, true)
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		go func() {
			br := bufio.NewReader(c)
			if i%2 == 1 {
				fmt.Fprintf(c, "GET /warm%d HTTP/1.1\r\nHost: %s\r\n\r\n", i, host)
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					res <- result{err: err}
					return
				}
				io.ReadAll(resp.Body)
			}
			fmt.Fprintf(c, "GET /hot HTTP/1.1\r\nHost: %s\r\n\r\n", host)
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				res <- result{err: err}
				return
			}
			b, err := io.ReadAll(resp.Body)
			res <- result{resp.StatusCode, string(b), err}
		}()
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return w.engine.Stats().Waiters == clients }, "waiters")
	time.Sleep(time.Second)
	select {
	case r := <-res:
		t.Fatalf("a client got an answer before the flight finished: %+v", r)
	default:
	}
	release.Open()
	for range clients {
		if r := <-res; r.err != nil || r.status != 200 || r.body != "body of /hot" {
			t.Errorf("client: %+v", r)
		}
	}
	if hits.Load() != 1 {
		t.Errorf("origin saw /hot %d times", hits.Load())
	}
}

// TestLeanTrailers: a GET's trailers (announced, and late) reach the
// client through the lean loop, on the proxy port and in a tunnel.
func TestLeanTrailers(t *testing.T) {
	h := http.HandlerFunc(sendTrailers)
	tlsO := tlsOrigin(t, h, true)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{tlsO.Certificate()}})
	for _, base := range []string{plainOrigin(t, h).URL, tlsO.URL} {
		for _, late := range []bool{false, true} {
			u, name, value := base+"/t", "X-Sum", "42"
			if late {
				u, name, value = u+"?late=1", "X-Late", "7"
			}
			resp, err := w.client(false).Get(u)
			if err != nil {
				t.Fatal(err)
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || string(b) != "body" {
				t.Fatalf("%s: %q %v", u, b, err)
			}
			if got := resp.Trailer.Get(name); got != value {
				t.Errorf("%s: trailer %s = %q, want %q (%v)", u, name, got, value, resp.Trailer)
			}
		}
	}
}

// TestShutdownWhileBusy: a lean request under way when Shutdown
// begins gets its whole answer, saying the connection closes, and
// Shutdown returns once it is sent.
func TestShutdownWhileBusy(t *testing.T) {
	release := testkit.NewGate(t)
	arrived := make(chan struct{}, 1)
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		release.Wait(r.Context())
		io.WriteString(rw, "late answer")
	}), true)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, dedup: dedupOn(dedup.Config{})})
	host := strings.TrimPrefix(origin.URL, "https://")
	c := insideTunnel(t, w, host, true)
	fmt.Fprintf(c, "GET /busy HTTP/1.1\r\nHost: %s\r\n\r\n", host)
	<-arrived
	time.Sleep(300 * time.Millisecond) // past watchAfter
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		done <- w.srv.Shutdown(ctx)
	}()
	time.Sleep(300 * time.Millisecond)
	release.Open()
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil || string(b) != "late answer" || !resp.Close {
		t.Fatalf("%d %q %v, close %v", resp.StatusCode, b, err, resp.Close)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Shutdown: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Shutdown still waits after the answer")
	}
}

// TestOverCapRequestCloses: an account already holding its
// proxy.max_conns_per_client is told 429 on a new connection's plain
// request, and that connection is closed after it (attribute's
// resp.Close), on the lean loop (GET) and on net/http (POST) alike: it
// does not stay open, holding a slot, until the idle timeout.
func TestOverCapRequestCloses(t *testing.T) {
	release := testkit.NewGate(t)
	var held atomic.Int64
	origin := plainOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hold" {
			held.Add(1)
			release.Wait(r.Context())
		}
		io.WriteString(rw, "ok")
	}))
	w := newWorld(t, worldOpts{proxy: proxy.Config{MaxConnsPerClient: 2}, users: map[string]string{"alice": "pw"}})
	host := strings.TrimPrefix(origin.URL, "http://")
	const auth = "Proxy-Authorization: Basic YWxpY2U6cHc=\r\n" // alice:pw
	dial := func() (net.Conn, *bufio.Reader) {
		c, err := net.Dial("tcp", w.proxyURL.Host)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		_ = c.SetDeadline(time.Now().Add(15 * time.Second))
		return c, bufio.NewReader(c)
	}
	// alice's two connections, busy with a request each: neither may be
	// shed to make room for a third (the address count stays below the
	// cap throughout).
	for range 2 {
		c, _ := dial()
		fmt.Fprintf(c, "GET %s/hold HTTP/1.1\r\nHost: %s\r\n%s\r\n", origin.URL, host, auth)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return held.Load() == 2 }, "alice's requests held")
	for _, method := range []string{"GET", "POST"} {
		c, br := dial()
		fmt.Fprintf(c, "%s %s/ HTTP/1.1\r\nHost: %s\r\nContent-Length: 0\r\n%s\r\n", method, origin.URL, host, auth)
		if method == "GET" {
			fmt.Fprintf(c, "GET %s/ HTTP/1.1\r\nHost: %s\r\n%s\r\n", origin.URL, host, auth)
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("%s: %v", method, err)
		}
		io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusTooManyRequests {
			t.Fatalf("%s over the cap: %d", method, resp.StatusCode)
		}
		if !resp.Close {
			t.Errorf("%s: the 429 does not say Connection: close", method)
		}
		_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
		if n, err := br.Read(make([]byte, 1)); err != io.EOF {
			t.Errorf("%s: the refused connection stays open after the 429 (%d, %v)", method, n, err)
		}
	}
}

// TestUnaskedSwitchIsRefused: an origin that answers a request
// asking for no upgrade with 101 Switching Protocols (RFC 9110 §15.2.2
// forbids it) gets the client a 502, not a protocol switch the client
// never asked for on a connection the proxy keeps speaking HTTP/1.1 on.
func TestUnaskedSwitchIsRefused(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, _, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\nraw")
	}))
	host := strings.TrimPrefix(origin.URL, "http://")
	for _, d := range []*dedup.Config{nil, dedupOn(dedup.Config{})} {
		w := newWorld(t, worldOpts{dedup: d})
		c, err := net.Dial("tcp", w.proxyURL.Host)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(15 * time.Second))
		fmt.Fprintf(c, "GET %s/x HTTP/1.1\r\nHost: %s\r\n\r\n", origin.URL, host)
		// A Go client takes a 101 with Connection: Upgrade for the switch
		// and reads the connection as the new protocol's: it waited out
		// the proxy's idle timeout (2 minutes) in io.ReadAll.
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != http.StatusBadGateway {
			t.Errorf("dedup %v: %d %v, want 502", d != nil, resp.StatusCode, resp.Header)
		}
	}
}
