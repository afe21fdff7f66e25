package proxy_test

import (
	"bufio"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/mitm"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// echoOrigin answers "METHOD PATH BODY" with a Content-Length, except on
// /chunked, which it sends in two flushed pieces without one.
func echoOrigin(t *testing.T, hits *atomic.Int64) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		body, _ := io.ReadAll(r.Body)
		if r.URL.Path == "/chunked" {
			io.WriteString(w, "first ")
			w.(http.Flusher).Flush()
			io.WriteString(w, "second")
			return
		}
		msg := fmt.Sprintf("%s %s %s", r.Method, r.URL.Path, body)
		w.Header().Set("Content-Length", fmt.Sprint(len(msg)))
		io.WriteString(w, msg)
	})
}

// readAnswers reads one response per request off br, in order.
func readAnswers(t *testing.T, br *bufio.Reader, methods ...string) []*http.Response {
	t.Helper()
	var out []*http.Response
	for i, m := range methods {
		resp, err := http.ReadResponse(br, &http.Request{Method: m})
		if err != nil {
			t.Fatalf("response %d: %v", i+1, err)
		}
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatalf("response %d body: %v", i+1, err)
		}
		resp.Body = io.NopCloser(strings.NewReader(string(b)))
		out = append(out, resp)
	}
	return out
}

func bodyOf(r *http.Response) string {
	b, _ := io.ReadAll(r.Body)
	return string(b)
}

// TestLeanLoopHandsOverToNetHTTP: requests pipelined in one intercepted
// tunnel (GETs for the lean loop, a POST with a body, which is net/http's,
// GETs after it) are all answered, in order, with their own bodies.
func TestLeanLoopHandsOverToNetHTTP(t *testing.T) {
	var hits atomic.Int64
	origin := tlsOrigin(t, echoOrigin(t, &hits), true)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, dedup: dedupOn(dedup.Config{})})
	host := strings.TrimPrefix(origin.URL, "https://")
	c := insideTunnel(t, w, host, true)
	fmt.Fprintf(c, "GET /a HTTP/1.1\r\nHost: %[1]s\r\n\r\n"+
		"GET /b HTTP/1.1\r\nHost: %[1]s\r\n\r\n"+
		"POST /c HTTP/1.1\r\nHost: %[1]s\r\nContent-Length: 3\r\n\r\nxyz"+
		"GET /d HTTP/1.1\r\nHost: %[1]s\r\n\r\n", host)
	got := readAnswers(t, bufio.NewReader(c), "GET", "GET", "POST", "GET")
	for i, want := range []string{"GET /a ", "GET /b ", "POST /c xyz", "GET /d "} {
		if got[i].StatusCode != 200 || bodyOf(got[i]) != want {
			t.Errorf("response %d: %d %q, want 200 %q", i+1, got[i].StatusCode, bodyOf(got[i]), want)
		}
	}
	if hits.Load() != 4 {
		t.Errorf("origin saw %d requests, want 4", hits.Load())
	}
}

// TestLeanLoopFraming: the lean loop frames what it answers as net/http
// would: a HEAD gets the Content-Length of its GET and no body, a body of
// unknown length goes chunked, "Connection: close" is honoured and said;
// and a head with bare LFs, or too big for the loop's buffer, is served
// all the same.
func TestLeanLoopFraming(t *testing.T) {
	var hits atomic.Int64
	origin := tlsOrigin(t, echoOrigin(t, &hits), true)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, dedup: dedupOn(dedup.Config{})})
	host := strings.TrimPrefix(origin.URL, "https://")

	c := insideTunnel(t, w, host, true)
	br := bufio.NewReader(c)
	fmt.Fprintf(c, "HEAD /h HTTP/1.1\r\nHost: %[1]s\r\n\r\nGET /chunked HTTP/1.1\r\nHost: %[1]s\r\n\r\n", host)
	got := readAnswers(t, br, "HEAD", "GET")
	if got[0].StatusCode != 200 || got[0].ContentLength != int64(len("HEAD /h ")) || bodyOf(got[0]) != "" {
		t.Errorf("HEAD: %d, length %d, body %q", got[0].StatusCode, got[0].ContentLength, bodyOf(got[0]))
	}
	if got[1].StatusCode != 200 || bodyOf(got[1]) != "first second" {
		t.Errorf("chunked: %d %q", got[1].StatusCode, bodyOf(got[1]))
	}

	fmt.Fprintf(c, "GET /lf HTTP/1.1\nHost: %s\n\n", host)
	big := strings.Repeat("c", 6000)
	fmt.Fprintf(c, "GET /big HTTP/1.1\r\nHost: %s\r\nCookie: v=%s\r\n\r\n", host, big)
	got = readAnswers(t, br, "GET", "GET")
	if bodyOf(got[0]) != "GET /lf " || bodyOf(got[1]) != "GET /big " {
		t.Errorf("bare LF: %q; big head: %q", bodyOf(got[0]), bodyOf(got[1]))
	}

	c2 := insideTunnel(t, w, host, true)
	br2 := bufio.NewReader(c2)
	fmt.Fprintf(c2, "GET /close HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", host)
	got = readAnswers(t, br2, "GET")
	if !got[0].Close || bodyOf(got[0]) != "GET /close " {
		t.Errorf("Connection: close: close %v, body %q", got[0].Close, bodyOf(got[0]))
	}
	if _, err := br2.ReadByte(); err != io.EOF {
		t.Errorf("after Connection: close the tunnel stays open: %v", err)
	}
}

// TestOnlyLongRequestsAreWatched: the lean loop watches for a client
// going away only while a request waits long enough for that to matter: a
// hit never starts the watch, nor does a miss answered at once, nor the
// leader of a slow flight (the flight runs on its goroutine, and nothing
// would act on its client leaving); a request waiting on a slow flight
// does.
func TestOnlyLongRequestsAreWatched(t *testing.T) {
	var hits atomic.Int64
	echo := echoOrigin(t, &hits)
	slow, release := make(chan struct{}, 1), make(chan struct{})
	origin := tlsOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			slow <- struct{}{}
			<-release
		}
		echo.ServeHTTP(w, r)
	}), true)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, dedup: dedupOn(dedup.Config{})})
	c := w.client(false)
	before := w.srv.LeanWatches()
	for i := range 21 {
		want := "HIT"
		if i == 0 {
			want = "MISS"
		}
		if resp, _ := w.get(c, origin.URL+"/hot"); resp.Header.Get("X-Cache") != want {
			t.Fatalf("request %d: X-Cache %q, want %q", i+1, resp.Header.Get("X-Cache"), want)
		}
	}
	if got := w.srv.LeanWatches() - before; got != 0 {
		t.Errorf("a fast miss and 20 hits started %d watches, want 0", got)
	}
	// fetch, not w.get: a failure in these goroutines must reach the
	// test as a result, not as a Fatal off its goroutine.
	led := make(chan fetched, 1)
	go func() { led <- fetch(context.Background(), w.client(false), origin.URL+"/slow") }()
	<-slow
	waited := make(chan fetched, 1)
	go func() { waited <- fetch(context.Background(), c, origin.URL+"/slow") }()
	// The waiter's watch starts watchAfter into its wait; then the
	// flight may end.
	testkit.Eventually(t, testkit.Patience, func() bool { return w.srv.LeanWatches()-before >= 1 }, "a watch")
	close(release)
	if got := <-waited; got.err != nil || got.xcache != "COALESCED" {
		t.Fatalf("waiter on the slow flight: %+v", got)
	}
	if got := <-led; got.err != nil || got.xcache != "MISS" {
		t.Fatalf("slow flight's leader: %+v", got)
	}
	if got := w.srv.LeanWatches() - before; got != 1 {
		t.Errorf("a slow flight's leader and a request waiting on it started %d watches, want 1", got)
	}
}

// TestPortLoopHandsOver: on the proxy port, plain http:// requests in
// absolute form are the lean loop's, and the first other request (a body,
// a CONNECT) goes to net/http with everything after it, in order: a POST
// between two GETs, and a CONNECT whose tunnel is then served.
func TestPortLoopHandsOver(t *testing.T) {
	var hits atomic.Int64
	origin := plainOrigin(t, echoOrigin(t, &hits))
	w := newWorld(t, worldOpts{dedup: dedupOn(dedup.Config{})})
	host := strings.TrimPrefix(origin.URL, "http://")

	c, err := net.Dial("tcp", w.proxyURL.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(15 * time.Second))
	fmt.Fprintf(c, "GET http://%[1]s/a HTTP/1.1\r\nHost: %[1]s\r\n\r\n"+
		"POST http://%[1]s/b HTTP/1.1\r\nHost: %[1]s\r\nContent-Length: 3\r\n\r\nxyz"+
		"GET http://%[1]s/c HTTP/1.1\r\nHost: %[1]s\r\n\r\n", host)
	got := readAnswers(t, bufio.NewReader(c), "GET", "POST", "GET")
	for i, want := range []string{"GET /a ", "POST /b xyz", "GET /c "} {
		if got[i].StatusCode != 200 || bodyOf(got[i]) != want {
			t.Errorf("response %d: %d %q, want 200 %q", i+1, got[i].StatusCode, bodyOf(got[i]), want)
		}
	}

	c2, err := net.Dial("tcp", w.proxyURL.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	_ = c2.SetDeadline(time.Now().Add(15 * time.Second))
	br := bufio.NewReader(c2)
	fmt.Fprintf(c2, "GET http://%[1]s/d HTTP/1.1\r\nHost: %[1]s\r\n\r\nCONNECT %[1]s HTTP/1.1\r\nHost: %[1]s\r\n\r\n", host)
	got = readAnswers(t, br, "GET")
	if bodyOf(got[0]) != "GET /d " {
		t.Fatalf("GET before the CONNECT: %d %q", got[0].StatusCode, bodyOf(got[0]))
	}
	// A CONNECT's answer has no body: the tunnel follows.
	if resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect}); err != nil || resp.StatusCode != 200 {
		t.Fatalf("CONNECT after a GET: %v, %v", resp, err)
	}
	fmt.Fprintf(c2, "GET /e HTTP/1.1\r\nHost: %s\r\n\r\n", host)
	got = readAnswers(t, br, "GET")
	if bodyOf(got[0]) != "GET /e " {
		t.Errorf("inside the tunnel: %d %q", got[0].StatusCode, bodyOf(got[0]))
	}
	if hits.Load() != 5 {
		t.Errorf("origin saw %d requests, want 5", hits.Load())
	}
}

// TestServeAfterShutdown: a Serve that comes after Shutdown returns at once
// and leaves nothing listening.
func TestServeAfterShutdown(t *testing.T) {
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	ca, err := mitm.LoadOrCreate(mitm.Config{CADir: t.TempDir()}, logger)
	if err != nil {
		t.Fatal(err)
	}
	defer ca.Close()
	srv, err := proxy.New(proxy.Config{Listen: "127.0.0.1:0"}, proxy.Options{Logger: logger, Certs: ca, Upstream: nowhere{}})
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Serve after Shutdown: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Serve after Shutdown still runs")
	}
	if c, err := net.DialTimeout("tcp", ln.Addr().String(), time.Second); err == nil {
		c.Close()
		t.Fatal("the listener still accepts after Serve returned")
	}
}

// TestShutdownClosesSilentConnections: a connection that has not begun a
// request (on the proxy port, or a tunnel just intercepted) has nothing
// to drain: Shutdown closes it at once instead of waiting out its header
// timeout.
func TestShutdownClosesSilentConnections(t *testing.T) {
	var hits atomic.Int64
	origin := tlsOrigin(t, echoOrigin(t, &hits), true)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, proxy: proxy.Config{ReadHeaderTimeout: time.Minute}})
	host := strings.TrimPrefix(origin.URL, "https://")
	port, err := net.Dial("tcp", w.proxyURL.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer port.Close()
	tunnel := insideTunnel(t, w, host, true)
	time.Sleep(50 * time.Millisecond) // both waiting for a request

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	start := time.Now()
	if err := w.srv.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Shutdown took %v with only silent connections open", d)
	}
	for name, c := range map[string]net.Conn{"proxy port": port, "tunnel": tunnel} {
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("%s connection still open after Shutdown: %v", name, err)
		}
	}
}

// TestLeanLoopHostRules: what net/http refuses about the Host field, the
// lean loop refuses too (it hands such a request over, and net/http
// answers 400): an absolute-form request without one, two of them, a
// malformed one. One Host field passes.
func TestLeanLoopHostRules(t *testing.T) {
	var hits atomic.Int64
	origin := plainOrigin(t, echoOrigin(t, &hits))
	w := newWorld(t, worldOpts{dedup: dedupOn(dedup.Config{})})
	host := strings.TrimPrefix(origin.URL, "http://")
	for _, tc := range []struct {
		name, head string
		want       int
	}{
		{"one Host", "GET http://%[1]s/ok HTTP/1.1\r\nHost: %[1]s\r\n\r\n", 200},
		{"no Host", "GET http://%[1]s/none HTTP/1.1\r\nAccept: */*\r\n\r\n", 400},
		{"two Hosts", "GET http://%[1]s/two HTTP/1.1\r\nHost: %[1]s\r\nhost: %[1]s\r\n\r\n", 400},
		{"malformed Host", "GET http://%[1]s/bad HTTP/1.1\r\nHost: a b\r\n\r\n", 400},
		// textproto trims spaces and tabs only: a no-break space stays,
		// and makes the field malformed.
		{"Host ending in a no-break space", "GET http://%[1]s/nbsp HTTP/1.1\r\nHost: %[1]s\u00a0\r\n\r\n", 400},
		// A folded line joins the field before it: "host evil".
		{"folded Host", "GET http://%[1]s/fold HTTP/1.1\r\nHost: %[1]s\r\n evil\r\n\r\n", 400},
		// An empty line where the request line should be: net/http's
		// answer, at once, not the header timeout's silence.
		{"blank line first", "\r\nGET http://%[1]s/blank HTTP/1.1\r\nHost: %[1]s\r\n\r\n", 400},
	} {
		c, err := net.Dial("tcp", w.proxyURL.Host)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(15 * time.Second))
		fmt.Fprintf(c, tc.head, host)
		got := readAnswers(t, bufio.NewReader(c), "GET")
		c.Close()
		if got[0].StatusCode != tc.want {
			t.Errorf("%s: %d %q, want %d", tc.name, got[0].StatusCode, bodyOf(got[0]), tc.want)
		}
	}
	if hits.Load() != 1 {
		t.Errorf("origin saw %d requests, want 1", hits.Load())
	}
}

// TestHandOffKeepsTheHeadersDeadline: a head sent slowly, which the lean
// loop hands to net/http once it outgrows the loop's buffer, still has to
// arrive within read_header_timeout of its start; net/http's own timeout
// would start afresh at the handoff and give it nearly twice that.
func TestHandOffKeepsTheHeadersDeadline(t *testing.T) {
	const timeout = 3 * time.Second
	w := newWorld(t, worldOpts{proxy: proxy.Config{ReadHeaderTimeout: timeout}})
	c, err := net.Dial("tcp", w.proxyURL.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(4 * timeout))
	start := time.Now()
	if _, err := io.WriteString(c, "GET http://127.0.0.1:9/slow HTTP/1.1\r\nHost: 127.0.0.1:9\r\nX-Pad: "); err != nil {
		t.Fatal(err)
	}
	// Late in the head's time, more than the loop's buffer holds, and
	// still no end of the head.
	time.Sleep(timeout * 6 / 10)
	_, _ = c.Write([]byte(strings.Repeat("a", 8<<10)))
	_, err = io.Copy(io.Discard, c)
	closed := time.Since(start)
	if err != nil {
		t.Fatalf("reading until the proxy closes: %v", err)
	}
	// Closed at timeout after the start; net/http's fresh timeout would
	// close it at 1.6 times that.
	if closed > timeout*13/10 {
		t.Errorf("the connection closed %v after the head began, want about %v", closed, timeout)
	}
}

// TestLeanLoopBodilessAnswersAsNetHTTP: a 204 and a 304 from the origin
// that carry a length (and, the 304, a type) reach the client without
// them, as net/http's server sends such answers.
func TestLeanLoopBodilessAnswersAsNetHTTP(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Raw, past net/http's own suppression.
		c, _, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		status := "204 No Content"
		if r.URL.Path == "/304" {
			status = "304 Not Modified"
		}
		fmt.Fprintf(c, "HTTP/1.1 %s\r\nContent-Type: text/html\r\nContent-Length: 5\r\nConnection: close\r\n\r\n", status)
	}))
	w := newWorld(t, worldOpts{dedup: dedupOn(dedup.Config{})})
	for _, path := range []string{"/204", "/304"} {
		c, err := net.Dial("tcp", w.proxyURL.Host)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(15 * time.Second))
		fmt.Fprintf(c, "GET %s%s HTTP/1.1\r\nHost: %s\r\n\r\n", origin.URL, path, strings.TrimPrefix(origin.URL, "http://"))
		resp := readAnswers(t, bufio.NewReader(c), "GET")[0]
		c.Close()
		if want := path[1:]; fmt.Sprint(resp.StatusCode) != want {
			t.Fatalf("%s: status %d", path, resp.StatusCode)
		}
		if _, ok := resp.Header["Content-Length"]; ok {
			t.Errorf("%s: Content-Length %q sent", path, resp.Header.Get("Content-Length"))
		}
		if ct, ok := resp.Header["Content-Type"]; ok && path == "/304" {
			t.Errorf("%s: Content-Type %q sent", path, ct)
		}
	}
}
