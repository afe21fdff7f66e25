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

func (c *coalescing) flush() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.hold = false
	_, err := c.Conn.Write(c.buf)
	c.buf = c.buf[:0]
	return err
}

// heldOrigin is a TLS origin that answers the first request on a
// connection and, in the same segment, sends behind (a close_notify when
// it is "", otherwise a record of data no request asked for); then it
// leaves the TCP connection open and reads on, answering nothing more.
// Only the records the client's TLS layer read ahead with the response
// tell that the connection is no longer fit. It returns the address, the
// dialer's TLS configuration, and the number of requests the origin has
// read.
func heldOrigin(t *testing.T, behind string) (addr string, cfg *tls.Config, requests func() int) {
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
			if behind == "" {
				tc.CloseWrite()
				// CloseWrite leaves a write deadline of now behind it.
				raw.SetWriteDeadline(time.Time{})
			} else {
				io.WriteString(tc, behind) // a record of its own
			}
			if cw.flush() != nil {
				return
			}
		}
	})
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		if conn != nil {
			conn.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String(), &tls.Config{RootCAs: pool, ServerName: "example.com"},
		func() int { mu.Lock(); defer mu.Unlock(); return n }
}

// TestH1RecordsReadWithTheResponse: records that arrived in the response's
// segment sit in the TLS layer, not on the socket, which stays open and
// has nothing to read. The idle check still goes through them: after a
// close_notify, or data no request asked for (which would otherwise be
// read as the next request's answer), the next request fails as
// unprocessed before any of it goes out.
func TestH1RecordsReadWithTheResponse(t *testing.T) {
	for _, tc := range []struct{ name, behind string }{
		{"close_notify", ""},
		{"data", h1Evil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr, cfg, requests := heldOrigin(t, tc.behind)
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
