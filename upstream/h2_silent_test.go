package upstream_test

import (
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// silentListener hands out connections of which the first stops reading
// once silent is set: an origin connection gone dead without a close (a
// NAT that forgot it, a peer that vanished).
type silentListener struct {
	net.Listener
	silent atomic.Bool
	n      atomic.Int32
	stop   chan struct{}
	once   sync.Once
}

func (l *silentListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &silentConn{Conn: c, l: l, first: l.n.Add(1) == 1}, nil
}

func (l *silentListener) Close() error {
	l.once.Do(func() { close(l.stop) })
	return l.Listener.Close()
}

type silentConn struct {
	net.Conn
	l     *silentListener
	first bool
}

// Read swallows what arrives once silent is set (a read may be under way
// when it is) and never returns again.
func (c *silentConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if c.first && c.l.silent.Load() {
		<-c.l.stop
		return 0, net.ErrClosed
	}
	return n, err
}

// TestSilentH2ConnectionIsLeft: an HTTP/2 origin connection on which a
// request times out waiting for its head takes no new request: the next
// one opens a connection of its own. It went on being handed the silent
// connection, each request costing a whole response_header_timeout, until
// the kernel gave up on it.
func TestSilentH2ConnectionIsLeft(t *testing.T) {
	origin := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Proto", r.Proto)
	}))
	ln := &silentListener{Listener: origin.Listener, stop: make(chan struct{})}
	origin.Listener = ln
	origin.EnableHTTP2 = true
	origin.StartTLS()
	defer origin.Close()
	c := client{name: "mirrored", fp: goFingerprint(t, "h2", "http/1.1")}
	p := newPool(t, upstream.Config{ResponseHeaderTimeout: 300 * time.Millisecond, CAFiles: []string{originCAFile(t, origin)}}, quiet)
	if resp, _, err := c.get(t, p, origin.URL+"/a"); err != nil || resp.Header.Get("X-Proto") != "HTTP/2.0" {
		t.Fatalf("first request: %v", err)
	}
	ln.silent.Store(true)
	if _, _, err := c.get(t, p, origin.URL+"/b"); err == nil {
		t.Fatal("a request on the silent connection got an answer")
	}
	start := time.Now()
	if _, _, err := c.get(t, p, origin.URL+"/c"); err != nil {
		t.Fatalf("after the timeout, after %v: %v", time.Since(start), err)
	}
	if n := ln.n.Load(); n != 2 {
		t.Errorf("%d origin connections, want 2", n)
	}
}

// TestDroppedH2ConnectionIsPinged: a request on an HTTP/2 origin
// connection that idled past ping_timeout goes out behind a PING. When the
// connection was dropped without a word, nothing answers it: within
// ping_timeout the request goes out again on a new connection and gets its
// answer, where it used to wait out response_header_timeout and fail.
func TestDroppedH2ConnectionIsPinged(t *testing.T) {
	origin := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Proto", r.Proto)
	}))
	ln := &silentListener{Listener: origin.Listener, stop: make(chan struct{})}
	origin.Listener = ln
	origin.EnableHTTP2 = true
	origin.StartTLS()
	defer origin.Close()
	const ping = 200 * time.Millisecond
	c := client{name: "mirrored", fp: goFingerprint(t, "h2", "http/1.1")}
	p := newPool(t, upstream.Config{ResponseHeaderTimeout: 10 * time.Second, PingTimeout: ping,
		CAFiles: []string{originCAFile(t, origin)}}, quiet)
	if resp, _, err := c.get(t, p, origin.URL+"/a"); err != nil || resp.Header.Get("X-Proto") != "HTTP/2.0" {
		t.Fatalf("first request: %v", err)
	}
	ln.silent.Store(true)
	time.Sleep(ping + 100*time.Millisecond) // idle past ping_timeout
	if resp, _, err := c.get(t, p, origin.URL+"/b"); err != nil || resp.Header.Get("X-Proto") != "HTTP/2.0" {
		t.Fatalf("request on the dropped connection: %v", err)
	}
	if n := ln.n.Load(); n != 2 {
		t.Errorf("%d origin connections, want 2", n)
	}
}

// TestWaitersShareAFailedH2Dial: requests that wait for another's HTTP/2
// dial to an origin share its failure. Each used to become the dialer in
// turn once the one before failed, so that against an origin that accepts
// and never answers the last of n requests failed after n handshake
// timeouts, and the origin saw n connections.
func TestWaitersShareAFailedH2Dial(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var accepted atomic.Int32
	var mu sync.Mutex
	var conns []net.Conn
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	}()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			mu.Lock()
			conns = append(conns, c) // held open, and never a word
			mu.Unlock()
		}
	}()
	const n = 8
	c := client{name: "mirrored", fp: goFingerprint(t, "h2", "http/1.1")}
	p := newPool(t, upstream.Config{TLSHandshakeTimeout: 300 * time.Millisecond}, quiet)
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			_, _, errs[i] = c.get(t, p, "https://"+ln.Addr().String()+"/")
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err == nil {
			t.Errorf("request %d answered by an origin that never speaks", i)
		}
	}
	// One dial that every request waits for, or two when a request comes
	// after the first dial has failed.
	if got := accepted.Load(); got > 2 {
		t.Errorf("the origin saw %d connections for %d requests at once, want the waiters to share the dial", got, n)
	}
}
