package upstream_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// idleOrigin is a plain HTTP/1.1 origin on loopback. Its first connection
// answers one request, then does idle to itself (closes it, or writes bytes
// no request asked for) once the test closes go, and closes acted when
// that is on the wire. Every other request gets "conn N", N the number of
// its connection.
type idleOrigin struct {
	addr  string
	goOn  chan struct{}
	acted chan struct{}
}

func startIdleOrigin(t *testing.T, idle func(c net.Conn)) *idleOrigin {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	o := &idleOrigin{addr: ln.Addr().String(), goOn: make(chan struct{}), acted: make(chan struct{})}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var conns []net.Conn
	var mu sync.Mutex
	wg.Add(1)
	go func() {
		defer wg.Done()
		for n := 1; ; n++ {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				br := bufio.NewReader(c)
				for i := 0; ; i++ {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					io.Copy(io.Discard, req.Body)
					body := fmt.Sprintf("conn %d", n)
					fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
					if n == 1 && i == 0 {
						select {
						case <-o.goOn:
						case <-stop:
							return
						}
						idle(c)
						close(o.acted)
					}
				}
			}()
		}
	}()
	t.Cleanup(func() {
		close(stop)
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return o
}

// TestMirroredIdleConnectionChecks: a pooled HTTP/1.1 connection the
// origin closed while it was idle, or sent bytes no request asked for, is
// not reused: the next request goes on a new connection, even a POST whose
// body cannot be sent twice (which no retry could save), and never reads
// the stray bytes as its answer. net/http behaves the same.
func TestMirroredIdleConnectionChecks(t *testing.T) {
	for _, tc := range []struct {
		name string
		idle func(c net.Conn)
	}{
		{"closed", func(c net.Conn) { c.Close() }},
		{"unsolicited bytes", func(c net.Conn) {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nEVIL!")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := startIdleOrigin(t, tc.idle)
			c := client{name: "mirrored", fp: goFingerprint(t, "http/1.1")}
			p := newPool(t, upstream.Config{}, quiet)
			u := "http://" + o.addr + "/"
			if r := c.mustGet(t, p, u, clientinfo.Info{}); r.status != 200 || r.body != "conn 1" {
				t.Fatalf("first request: %+v", r)
			}
			close(o.goOn)
			<-o.acted

			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, nil)
			if err != nil {
				t.Fatal(err)
			}
			req.Body = io.NopCloser(strings.NewReader("a=1")) // no GetBody: not replayable
			req.ContentLength = 3
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			resp, err := p.RoundTrip(c.request(req))
			if err != nil {
				t.Fatalf("POST after the origin's move: %v", err)
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != 200 || string(b) != "conn 2" {
				t.Fatalf("POST after the origin's move: %d %q, %v; want the answer on a new connection", resp.StatusCode, b, err)
			}
		})
	}
}
