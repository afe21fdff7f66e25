package mirror

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/fporigin"
)

// coalescing holds what is written on it from hold until flush, which
// sends it in one write: a TLS server over it puts several records in one
// segment.
type coalescing struct {
	net.Conn
	mu   sync.Mutex
	hold bool
	buf  []byte
}

func (c *coalescing) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.hold {
		c.buf = append(c.buf, p...)
		return len(p), nil
	}
	return c.Conn.Write(p)
}

func (c *coalescing) holdWrites() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.hold = true
}

func (c *coalescing) flush() error { return c.flushTo(-1) }

// flushTo sends the first n bytes held (all when n < 0) and drops the
// rest, which never go out.
func (c *coalescing) flushTo(n int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.hold = false
	if n < 0 || n > len(c.buf) {
		n = len(c.buf)
	}
	_, err := c.Conn.Write(c.buf[:n])
	c.buf = c.buf[:0]
	return err
}

// held is how many bytes are held.
func (c *coalescing) held() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.buf)
}

// stray is what heldOrigin sends behind its first response.
type stray struct {
	data string // a record of data no request asked for; "": a close_notify
	// part > 0 sends only the first part bytes of the record: the rest
	// never comes, and the client's TLS layer waits for it.
	part int
	// idle sends it in a segment of its own, on the idle connection, once
	// the test asks (heldOrigin's send), instead of in the response's.
	idle bool
}

// heldOrigin is a TLS origin that answers the first request on a
// connection and sends behind in the same segment (see stray); then it
// leaves the TCP connection open and reads on, answering nothing more.
// Only the bytes the client's TLS layer read ahead with the response
// tell that the connection is no longer fit. It returns the address, the
// dialer's TLS configuration, the number of requests the origin has
// read, and, for a stray sent on the idle connection, the function that
// sends it and returns once it is on the wire.
func heldOrigin(t *testing.T, behind stray) (addr string, cfg *tls.Config, requests func() int, send func()) {
	t.Helper()
	srv := httptest.NewUnstartedServer(nil)
	srv.StartTLS()
	server := srv.TLS.Clone()
	server.NextProtos = []string{"http/1.1"}
	pool := x509.NewCertPool()
	pool.AddCert(srv.Certificate())
	srv.Close()

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var n int
	var conn net.Conn
	ask, sent, quit := make(chan struct{}), make(chan struct{}), make(chan struct{})
	wg.Go(func() {
		raw, err := ln.Accept()
		if err != nil {
			return
		}
		mu.Lock()
		conn = raw
		mu.Unlock()
		defer raw.Close()
		cw := &coalescing{Conn: raw}
		tc := tls.Server(cw, server)
		br := bufio.NewReader(tc)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			io.Copy(io.Discard, req.Body)
			mu.Lock()
			n++
			first := n == 1
			mu.Unlock()
			if !first {
				continue // read, and left unanswered
			}
			cw.holdWrites()
			io.WriteString(tc, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			if behind.idle {
				if cw.flush() != nil {
					return
				}
				select {
				case <-ask:
				case <-quit:
					return
				}
				cw.holdWrites()
			}
			upTo := -1
			if behind.part > 0 {
				upTo = cw.held() + behind.part
			}
			if behind.data == "" {
				tc.CloseWrite()
				// CloseWrite leaves a write deadline of now behind it.
				raw.SetWriteDeadline(time.Time{})
			} else {
				io.WriteString(tc, behind.data) // a record of its own
			}
			if cw.flushTo(upTo) != nil {
				return
			}
			if behind.idle {
				close(sent)
			}
		}
	})
	t.Cleanup(func() {
		close(quit)
		ln.Close()
		mu.Lock()
		if conn != nil {
			conn.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String(), &tls.Config{RootCAs: pool, ServerName: "example.com"},
		func() int { mu.Lock(); defer mu.Unlock(); return n },
		func() {
			close(ask)
			select {
			case <-sent:
			case <-time.After(5 * time.Second):
				t.Error("the origin did not send its stray bytes")
			}
		}
}

// TestH1RecordsReadWithTheResponse: records that arrived in the response's
// segment sit in the TLS layer, not on the socket, which stays open and
// has nothing to read. The idle check still goes through them: after a
// close_notify, or data no request asked for (which would otherwise be
// read as the next request's answer), the next request fails as
// unprocessed before any of it goes out.
//
// Part of a record (one the origin began to send, on the idle connection
// or behind the response) leaves the TLS layer waiting for the rest, off
// the socket, where the check's peek no longer sees it: it fails the
// check too. Taken for fit, the connection would read the next request's
// answer behind the stray record, or from it once its rest came.
func TestH1RecordsReadWithTheResponse(t *testing.T) {
	for _, tc := range []struct {
		name   string
		behind stray
	}{
		{"close_notify", stray{}},
		{"data", stray{data: h1Evil}},
		{"part of a record", stray{data: h1Evil, part: 10}},
		{"part of a record, its header alone", stray{data: h1Evil, part: 3}},
		{"part of a record, on the idle connection", stray{data: h1Evil, part: 10, idle: true}},
		{"data, on the idle connection", stray{data: h1Evil, idle: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr, cfg, requests, send := heldOrigin(t, tc.behind)
			var cd countingDialer
			d := &Dialer{Dial: cd.dial, TLSConfig: cfg}
			ctx := ctxTimeout(t, 10*time.Second)
			c, err := d.DialTLS(ctx, "tcp", addr, goHello(t, "http/1.1"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			cc, err := NewClientConn(c, c.ConnectionState().NegotiatedProtocol, nil, Options{})
			if err != nil {
				t.Fatal(err)
			}
			resp, err := cc.RoundTrip(newRequest(t, ctx, "GET", "https://"+addr+"/first", nil))
			if err != nil {
				t.Fatal(err)
			}
			if b, _ := io.ReadAll(resp.Body); string(b) != "ok" {
				t.Fatalf("first body %q", b)
			}
			resp.Body.Close()
			if tc.behind.idle {
				send()
			}

			req := newRequest(t, ctx, "POST", "https://"+addr+"/second", nil)
			req.Body = io.NopCloser(strings.NewReader("a=1"))
			req.ContentLength = 3
			resp, err = cc.RoundTrip(req)
			if err == nil {
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				t.Fatalf("second request answered %d %q on a connection no longer fit", resp.StatusCode, b)
			}
			if !errors.Is(err, ErrUnprocessed) {
				t.Fatalf("second request: %v; want an unprocessed request", err)
			}
			// Had the POST gone out, the origin, still reading, would
			// have counted it.
			time.Sleep(20 * time.Millisecond)
			if n := requests(); n != 1 {
				t.Errorf("the origin read %d requests, want 1", n)
			}
		})
	}
}

// TestReadHeldLeavesTheConnectionUsable: with nothing held, readHeld fails
// as a read past its deadline does, at once, and the TLS session goes on:
// the next request on the connection is answered.
func TestReadHeldLeavesTheConnectionUsable(t *testing.T) {
	o := startOrigin(t, fporigin.Options{NextProtos: []string{"http/1.1"}})
	cc, c := openConn(t, o, goHello(t, "http/1.1"), nil, Options{})
	getRoot(t, cc, o)
	for range 3 {
		n, err := c.readHeld(make([]byte, 16))
		if n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("readHeld on an idle connection: %d, %v; want 0 and a deadline's error", n, err)
		}
	}
	getRoot(t, cc, o)
}

// BenchmarkH1IdleCheck is the look at an idle HTTP/1.1 connection over
// the mirror's TLS before it takes a request, as a pool runs it once per
// reused connection:
//
//	go test -run '^$' -bench H1IdleCheck ./upstream/mirror/
func BenchmarkH1IdleCheck(b *testing.B) {
	o, err := fporigin.Start(fporigin.Options{NextProtos: []string{"http/1.1"}})
	if err != nil {
		b.Fatal(err)
	}
	defer o.Close()
	var cd countingDialer
	ctx := ctxTimeout(b, 10*time.Second)
	c, err := newDialer(o, &cd).DialTLS(ctx, "tcp", o.Addr(), goHello(b, "http/1.1"))
	if err != nil {
		b.Fatal(err)
	}
	cc := NewH1Conn(c, Options{})
	defer cc.Close()
	resp, err := cc.RoundTrip(newRequest(b, ctx, "GET", o.URL()+"/", nil))
	if err != nil {
		b.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	b.ReportAllocs()
	for b.Loop() {
		if err := cc.Probe(); err != nil {
			b.Fatal(err)
		}
	}
}

// TestRecordFramer: however a stream of records is cut into reads, the
// framer is inside a record exactly when the bytes so far stop short of a
// record's end.
func TestRecordFramer(t *testing.T) {
	var stream []byte
	var ends []int // where each record ends
	for _, size := range []int{0, 1, 4, 255, 256, 300, 16384 + 256} {
		stream = append(stream, 23, 3, 3, byte(size>>8), byte(size))
		stream = append(stream, make([]byte, size)...)
		ends = append(ends, len(stream))
	}
	atEnd := func(n int) bool { return n == 0 || slices.Contains(ends, n) }
	for _, step := range []int{1, 2, 3, 5, 7, 64, 1000, len(stream)} {
		var f recordFramer
		for off := 0; off < len(stream); off += step {
			end := min(off+step, len(stream))
			f.feed(stream[off:end])
			if got, want := f.within(), !atEnd(end); got != want {
				t.Fatalf("reads of %d: after %d bytes within() = %v, want %v", step, end, got, want)
			}
		}
	}
}
