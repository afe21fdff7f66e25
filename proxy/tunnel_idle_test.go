package proxy_test

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
)

// silentSink is an upstream that reads until the client's EOF and then
// says nothing and never closes. Once check is called (after the client saw
// its tunnel cut), it reports whether the proxy has closed the upstream
// side too: a write to a connection the peer closed fails, after the first
// one (which the peer answers with a reset).
func silentSink(t *testing.T) (addr string, check func() bool) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	checking := make(chan struct{})
	closed := make(chan bool, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			closed <- false
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		io.Copy(io.Discard, c) // until the tunnel passes the client's EOF on
		<-checking
		for range 100 {
			if _, err := c.Write([]byte{0}); err != nil {
				closed <- true
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
		closed <- false
	}()
	var once sync.Once
	t.Cleanup(func() {
		ln.Close()
		once.Do(func() { close(checking) })
	})
	return ln.Addr().String(), func() bool {
		once.Do(func() { close(checking) })
		return <-closed
	}
}

// expectCut asserts that the proxy closed c (an EOF or a reset), not our
// own read deadline, and that it closed the upstream side too.
func expectCut(t *testing.T, c net.Conn, r io.Reader, upstreamClosed func() bool) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err := io.ReadAll(r)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("the half-closed tunnel outlived proxy.idle_timeout (our own 10s deadline fired): %v", err)
	}
	if !upstreamClosed() {
		t.Fatal("the upstream side of the idle tunnel was not closed")
	}
}

// TestSOCKS5HalfClosedIdleTunnelIsClosed: a client that half-closes a
// blind tunnel (or vanishes) leaves only the upstream side being read; when
// the upstream then stays silent, the tunnel is idle and must be cut after
// proxy.idle_timeout like any other, not held (with its connection slot)
// until upstream.idle_timeout.
func TestSOCKS5HalfClosedIdleTunnelIsClosed(t *testing.T) {
	sink, sinkClosed := silentSink(t)
	w := newWorld(t, worldOpts{
		proxy:  proxy.Config{IdleTimeout: 300 * time.Millisecond},
		socks5: socksOn(socks.Config{AllowNoAuth: true}),
	})
	c := socksTunnelTCP(t, w, sink)
	if _, err := io.WriteString(c, "\x00bye"); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	expectCut(t, c, c, sinkClosed)
}

// TestBypassHalfClosedIdleTunnelIsClosed: the same on the HTTP port, for
// the blind tunnel of a bypass host.
func TestBypassHalfClosedIdleTunnelIsClosed(t *testing.T) {
	sink, sinkClosed := silentSink(t)
	w := newWorld(t, worldOpts{proxy: proxy.Config{IdleTimeout: 300 * time.Millisecond, BypassHosts: []string{"127.0.0.1"}}})
	conn, err := net.Dial("tcp", w.proxyURL.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", sink, sink)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %v %v", resp, err)
	}
	if _, err := io.WriteString(conn, "bye"); err != nil {
		t.Fatal(err)
	}
	if err := conn.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	expectCut(t, conn, br, sinkClosed)
}
