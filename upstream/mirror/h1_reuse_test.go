package mirror

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/fporigin"
	"github.com/seed-a3c387e8/onceproxy/internal/halfclose"
	"github.com/seed-a3c387e8/onceproxy/internal/idleconn"
	"github.com/seed-a3c387e8/onceproxy/internal/readahead"
)

// h1Evil is what an origin out of step with the proxy's framing leaves on a
// connection: it reads as a response to whatever request comes next.
const h1Evil = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nEVIL!"

// h1Real is the answer to every request after the first.
const h1Real = "HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nREAL"

// h1Script is what a test origin does on one connection: first answers the
// first request; once the test closes idle, it sends later (if any) on
// the idle connection, then closes it (hangUp) or resets it (reset); it
// closes done when that is on the wire. Later requests get next.
type h1Script struct {
	first, later, next string
	hangUp, reset      bool

	idle     chan struct{} // closed by the test: the first response was read
	done     chan struct{} // closed by the origin: later, the close or the reset went out
	ended    chan struct{} // closed by the origin when the connection ended
	requests int           // the requests the origin read, once ended is closed
}

func newH1Script(first, later string, hangUp, reset bool) *h1Script {
	return &h1Script{first: first, later: later, next: h1Real, hangUp: hangUp, reset: reset,
		idle: make(chan struct{}), done: make(chan struct{}), ended: make(chan struct{})}
}

// run plays s on c, which the origin reads through br; read says whether
// the first request was read already. It returns when the connection ends
// or stop is closed.
func (s *h1Script) run(c net.Conn, br *bufio.Reader, read bool, stop <-chan struct{}) {
	defer close(s.ended)
	defer c.Close()
	for ; ; s.requests++ {
		if s.requests > 0 || !read {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			io.Copy(io.Discard, req.Body)
		}
		if s.requests > 0 {
			io.WriteString(c, s.next)
			continue
		}
		io.WriteString(c, s.first)
		select {
		case <-s.idle:
		case <-stop:
			return
		}
		if s.later != "" {
			io.WriteString(c, s.later)
		}
		switch {
		case s.reset:
			c.(*net.TCPConn).SetLinger(0)
			fallthrough
		case s.hangUp:
			c.Close()
		}
		close(s.done)
	}
}

// h1PlainOrigin serves one connection on a loopback listener with s. The
// test ends it by closing the client's connection.
func h1PlainOrigin(t *testing.T, s *h1Script) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		c, err := ln.Accept()
		if err != nil {
			return
		}
		s.run(c, bufio.NewReader(c), false, stop)
	}()
	t.Cleanup(func() {
		close(stop)
		ln.Close()
		wg.Wait()
	})
	return ln.Addr().String()
}

// h1Dial connects to addr; wrapped puts the connection under the
// wrappers the proxy's dialers return (an idle timeout over a tunnel's
// read-ahead), which the idle check must see through to the socket.
func h1Dial(t *testing.T, addr string, wrapped bool) *H1Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	if wrapped {
		c = idleconn.Wrap(&readahead.Conn{Conn: halfclose.Conn{Conn: c}}, time.Minute)
	}
	cc := NewH1Conn(c, Options{})
	t.Cleanup(func() { cc.Close() })
	return cc
}

// h1Exchange sends the first request of s on cc and reads its answer, lets
// the origin act on the idle connection, then sends a POST whose body
// cannot be sent twice. It returns the POST's outcome.
func h1Exchange(t *testing.T, cc ClientConn, s *h1Script, url, method string) (status int, body string, err error) {
	t.Helper()
	ctx := ctxTimeout(t, 10*time.Second)
	resp, err := cc.RoundTrip(newRequest(t, ctx, method, url+"/first", nil))
	if err != nil {
		t.Fatalf("first request: %v", err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	close(s.idle)
	<-s.done
	req := newRequest(t, ctx, "POST", url+"/second", nil)
	req.Body = io.NopCloser(strings.NewReader("a=1"))
	req.ContentLength = 3
	resp, err = cc.RoundTrip(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// TestH1UnsolicitedBytesEndReuse: bytes past the end of a response, read
// with it or arriving while the connection is idle, are never taken for
// the next request's answer: that request fails as unprocessed (a caller
// sends it again on a new connection, as net/http does), before anything
// of it goes out.
func TestH1UnsolicitedBytesEndReuse(t *testing.T) {
	for _, tc := range []struct {
		name, method, first, later string
	}{
		{"204 with bytes after it", "GET", "HTTP/1.1 204 No Content\r\n\r\n" + h1Evil, ""},
		{"HEAD answered with a body", "HEAD", "HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world", ""},
		{"bytes past Content-Length", "GET", "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" + h1Evil, ""},
		{"bytes while idle", "GET", "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", h1Evil},
		{"304 then bytes while idle", "GET", "HTTP/1.1 304 Not Modified\r\n\r\n", h1Evil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newH1Script(tc.first, tc.later, false, false)
			addr := h1PlainOrigin(t, s)
			cc := h1Dial(t, addr, false)
			status, body, err := h1Exchange(t, cc, s, "http://"+addr, tc.method)
			if !errors.Is(err, ErrUnprocessed) {
				t.Fatalf("second request: %d %q, %v; want an unprocessed request", status, body, err)
			}
			if cc.CanTakeRequest() {
				t.Error("the connection still takes requests")
			}
		})
	}
}

// TestH1IdleConnectionClosedByTheOrigin: a connection the origin closed
// (or reset) while it was idle fails the next request as unprocessed,
// before anything of it is sent: a POST whose body cannot be sent twice
// may go again on a new connection. The check does not stop the reuse of a
// connection the origin keeps.
func TestH1IdleConnectionClosedByTheOrigin(t *testing.T) {
	const ok = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
	for _, tc := range []struct {
		name                   string
		hangUp, reset, wrapped bool
	}{
		{"FIN", true, false, false},
		{"RST", false, true, false},
		{"kept", false, false, false},
		{"FIN under wrappers", true, false, true},
		{"kept under wrappers", false, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newH1Script(ok, "", tc.hangUp, tc.reset)
			addr := h1PlainOrigin(t, s)
			cc := h1Dial(t, addr, tc.wrapped)
			status, body, err := h1Exchange(t, cc, s, "http://"+addr, "GET")
			if !tc.hangUp && !tc.reset {
				if err != nil || status != 200 || body != "REAL" {
					t.Fatalf("second request on a kept connection: %d %q, %v", status, body, err)
				}
				return
			}
			if !errors.Is(err, ErrUnprocessed) {
				t.Fatalf("second request: %d %q, %v; want an unprocessed request", status, body, err)
			}
		})
	}
}

// TestH1TLSIdleConnection is the idle check over the mirror's TLS
// connections: a close_notify while idle ends the connection; data while
// idle, or past the response in the TLS layer's hands, is unsolicited; a
// connection with nothing on it is reused.
func TestH1TLSIdleConnection(t *testing.T) {
	const ok = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
	for _, tc := range []struct {
		name   string
		s      *h1Script
		reused bool
	}{
		{"close_notify", newH1Script(ok, "", true, false), false},
		{"data while idle", newH1Script(ok, h1Evil, false, false), false},
		{"data in the response's record", newH1Script(ok+h1Evil, "", false, false), false},
		{"nothing", newH1Script(ok, "", false, false), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			stop := make(chan struct{})
			var wg sync.WaitGroup
			t.Cleanup(func() {
				close(stop)
				wg.Wait()
			})
			o := startOrigin(t, fporigin.Options{NextProtos: []string{"http/1.1"}, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				// The rest of the connection is the script's, raw: the
				// request read is the first one.
				c, brw, err := w.(http.Hijacker).Hijack()
				if err != nil {
					return
				}
				wg.Add(1)
				defer wg.Done()
				tc.s.run(c, brw.Reader, true, stop)
			})})
			cc, _ := openConn(t, o, goHello(t, "http/1.1"), nil, Options{})
			status, body, err := h1Exchange(t, cc, tc.s, o.URL(), "GET")
			if tc.reused {
				if err != nil || status != 200 || body != "REAL" {
					t.Fatalf("second request on a kept connection: %d %q, %v", status, body, err)
				}
				cc.Close()
				<-tc.s.ended
				if tc.s.requests != 2 {
					t.Errorf("the origin got %d requests on the connection, want 2", tc.s.requests)
				}
				return
			}
			if !errors.Is(err, ErrUnprocessed) {
				t.Fatalf("second request: %d %q, %v; want an unprocessed request", status, body, err)
			}
		})
	}
}

// h1RecordConn is a record layer over a TCP connection, as TLS is: records
// of type 'd' carry data, 'h' records are the layer's own (a TLS session
// ticket or key update), which Read consumes and reads on past, as
// utls's does, and 'a' is a close alert (EOF). A record is a type byte, a
// length byte and the payload. It lets a test send a record of the
// layer's own on an idle connection, which no TLS server does on demand.
type h1RecordConn struct {
	net.Conn
	br      *bufio.Reader
	pending []byte // data of the last 'd' record not yet read
}

func (c *h1RecordConn) NetConn() net.Conn { return c.Conn }

func (c *h1RecordConn) Read(p []byte) (int, error) {
	for len(c.pending) == 0 {
		// Peek, not Read: a timeout leaves a partial record in place, as
		// TLS keeps it, for the next read.
		hdr, err := c.br.Peek(2)
		if err != nil {
			return 0, err
		}
		rec, err := c.br.Peek(2 + int(hdr[1]))
		if err != nil {
			return 0, err
		}
		c.br.Discard(len(rec))
		switch rec[0] {
		case 'd':
			c.pending = append(c.pending, rec[2:]...)
		case 'a':
			return 0, io.EOF
		}
	}
	n := copy(p, c.pending)
	c.pending = c.pending[n:]
	return n, nil
}

func h1Record(typ byte, payload string) string {
	return string([]byte{typ, byte(len(payload))}) + payload
}

// TestH1IdleCheckLetsTLSRecordsThrough: records that arrive on an idle TLS
// connection are read through the TLS layer: one of its own leaves the
// connection fit for the next request; a close alert ends it; data, or
// data the layer read ahead with the response, is unsolicited.
func TestH1IdleCheckLetsTLSRecordsThrough(t *testing.T) {
	ok := h1Record('d', "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
	for _, tc := range []struct {
		name, first, later string
		reused             bool
	}{
		{"a record of the layer's own", ok, h1Record('h', "session ticket"), true},
		{"a close alert", ok, h1Record('a', ""), false},
		{"data", ok, h1Record('d', h1Evil), false},
		{"data read ahead with the response", ok + h1Record('d', h1Evil), "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newH1Script(tc.first, tc.later, false, false)
			s.next = h1Record('d', h1Real)
			addr := h1PlainOrigin(t, s)
			raw, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			cc := NewH1Conn(&h1RecordConn{Conn: raw, br: bufio.NewReader(raw)}, Options{})
			ctx := ctxTimeout(t, 10*time.Second)
			resp, err := cc.RoundTrip(newRequest(t, ctx, "GET", "http://"+addr+"/first", nil))
			if err != nil {
				cc.Close()
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			close(s.idle)
			<-s.done
			resp, err = cc.RoundTrip(newRequest(t, ctx, "GET", "http://"+addr+"/second", nil))
			var body []byte
			if err == nil {
				body, _ = io.ReadAll(resp.Body)
				resp.Body.Close()
			}
			cc.Close()
			<-s.ended
			if tc.reused {
				if err != nil || string(body) != "REAL" || s.requests != 2 {
					t.Fatalf("second request: %q, %v; the origin got %d requests on the connection, want 2", body, err, s.requests)
				}
				return
			}
			if !errors.Is(err, ErrUnprocessed) || s.requests != 1 {
				t.Fatalf("second request: %q, %v; the origin got %d requests; want an unprocessed request, never sent", body, err, s.requests)
			}
		})
	}
}

// TestH1InterimResponsesShareTheHeaderBudget: 1xx responses count against
// MaxResponseHeaderBytes with the final head, as under net/http: an origin
// sending them without end fails the request instead of holding it. A few
// Early Hints still pass.
func TestH1InterimResponsesShareTheHeaderBudget(t *testing.T) {
	const hint = "HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload; as=style\r\n\r\n"
	for _, tc := range []struct {
		name  string
		hints int
		ok    bool
	}{
		{"a few", 3, true},
		{"without end", 1000, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newH1Script(strings.Repeat(hint, tc.hints)+"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", "", true, false)
			addr := h1PlainOrigin(t, s)
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			cc := NewH1Conn(c, Options{MaxResponseHeaderBytes: 4 << 10})
			defer cc.Close()
			defer close(s.idle)
			resp, err := cc.RoundTrip(newRequest(t, ctxTimeout(t, 10*time.Second), "GET", "http://"+addr+"/", nil))
			if !tc.ok {
				if err == nil || !strings.Contains(err.Error(), "over 4096 bytes") {
					t.Fatalf("%d Early Hints: %v, want the header limit", tc.hints, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != 200 || string(b) != "ok" {
				t.Fatalf("%d %q, %v", resp.StatusCode, b, err)
			}
		})
	}
}
