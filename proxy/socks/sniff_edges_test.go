package socks_test

import (
	"io"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
)

// TestSlowHTTPClientOnAMITMPortIsIntercepted: a client on a MITM port that
// has begun its request line ("GE") when sniff_timeout passes, and sends
// the rest later, is still an HTTP client: it is intercepted, as a client
// that said nothing before the timeout would be, not tunnelled blind on
// the strength of two bytes.
func TestSlowHTTPClientOnAMITMPortIsIntercepted(t *testing.T) {
	// The origin a blind tunnel would reach: it answers "blind" to
	// whatever it gets.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(10 * time.Second))
				if _, err := c.Read(make([]byte, 1)); err == nil {
					io.WriteString(c, "blind")
				}
			}()
		}
	}()
	_, portStr, _ := net.SplitHostPort(ln.Addr().String())
	port, _ := strconv.Atoi(portStr)

	const sniffTimeout = 100 * time.Millisecond
	p := &pipeline{}
	_, addr := serve(t, p, socks.Config{AllowNoAuth: true, MITMPorts: []int{port}, SniffTimeout: sniffTimeout})
	c, code := connect(t, addr, "127.0.0.1", port, "GE")
	if code != 0 {
		t.Fatalf("reply %d, want 0", code)
	}
	// The sniff began before the reply was sent: after this pause its
	// timeout has passed, with "GE" read.
	time.Sleep(3 * sniffTimeout)
	if _, err := io.WriteString(c, "T / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(c)
	if err != nil || string(b) != "ok" {
		t.Fatalf("stream answered %q, %v; want the interception's \"ok\"", b, err)
	}
	if _, _, intercepted := p.record(); len(intercepted) != 1 {
		t.Fatalf("intercepted %+v, want the one stream", intercepted)
	}
}
