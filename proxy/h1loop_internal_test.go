package proxy

import (
	"bufio"
	"context"
	"net"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/capture"
)

func TestHeadEnd(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int
	}{
		{"GET / HTTP/1.1\r\nHost: a\r\n\r\n", 27},
		{"GET / HTTP/1.1\r\nHost: a\r\n\r\nGET /next", 27},
		{"GET / HTTP/1.1\nHost: a\n\n", 24},
		{"GET / HTTP/1.1\r\nHost: a\n\r\n", 26},
		{"GET / HTTP/1.1\r\nHost: a\r\n", 0},
		{"GET / HTTP/1.1\r\n", 0},
		{"\r\nGET / HTTP/1.1\r\n\r\n", -1}, // a leading blank line: net/http's to judge
		{"\nGET / HTTP/1.1\r\n\r\n", -1},
		{"\r", 0}, // maybe a blank line: wait for its end
		{"", 0},
	} {
		if got := headEnd([]byte(tc.in)); got != tc.want {
			t.Errorf("headEnd(%q) = %d, want %d", tc.in, got, tc.want)
		}
	}
}

// TestH1CtxLazyDone: a lean request's context is a context like any other:
// Err and Done agree, cancellation reaches Done whether it was asked for
// before or after, and contexts derived from it (which register through
// AfterFunc) are cancelled with it, or not at all once they stopped.
func TestH1CtxLazyDone(t *testing.T) {
	client, server := net.Pipe()
	defer client.Close()
	h := &h1Conn{s: &Server{}, loop: &h1Loop{}, c: &tappedConn{Conn: capture.NewConn(server, nil)}, br: bufio.NewReader(server)}
	x := &h1Ctx{Context: context.Background(), h: h}

	child, stopChild := context.WithCancel(x)
	defer stopChild()
	stopped := 0
	stop := context.AfterFunc(x, func() { stopped++ })
	if !stop() {
		t.Fatal("stop of a pending AfterFunc reported false")
	}
	if x.Err() != nil || child.Err() != nil {
		t.Fatal("cancelled before cancel")
	}
	x.cancel(context.Canceled)
	select {
	case <-child.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("a derived context was not cancelled")
	}
	if x.Err() != context.Canceled || child.Err() != context.Canceled {
		t.Fatalf("Err = %v, child %v", x.Err(), child.Err())
	}
	select {
	case <-x.Done():
	default:
		t.Fatal("Done asked for after cancel is not closed")
	}
	if stopped != 0 {
		t.Fatal("a stopped AfterFunc ran")
	}
	late := make(chan struct{})
	context.AfterFunc(x, func() { close(late) })
	select {
	case <-late:
	case <-time.After(5 * time.Second):
		t.Fatal("an AfterFunc registered after cancel did not run")
	}
	h.stopWatch()
	server.Close()
}

// TestWatchSeesTheClientLeave: a request whose context was asked for Done
// is cancelled when its client closes the connection.
func TestWatchSeesTheClientLeave(t *testing.T) {
	client, server := net.Pipe()
	h := &h1Conn{s: &Server{}, loop: &h1Loop{}, c: &tappedConn{Conn: capture.NewConn(server, nil)}, br: bufio.NewReader(server)}
	x := &h1Ctx{Context: context.Background(), h: h}
	done := x.Done()
	client.Close()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the client left and the request's context is not done")
	}
	h.stopWatch()
	server.Close()
}

func TestHostField(t *testing.T) {
	for _, tc := range []struct {
		head, host string
		ok         bool
	}{
		{"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n", "a.test", true},
		{"GET http://x:80/ HTTP/1.1\r\nhost:  b.test:8080 \r\n\r\n", "b.test:8080", true},
		{"GET / HTTP/1.1\r\nAccept: */*\r\n\r\n", "", false},
		{"GET / HTTP/1.1\r\nHost: a\r\nHOST: b\r\n\r\n", "b", false},
		{"GET / HTTP/1.1\r\nX-Host: a\r\nReferer: http://Host:1/\r\n\r\n", "", false},
	} {
		if host, ok := hostField([]byte(tc.head)); host != tc.host || ok != tc.ok {
			t.Errorf("hostField(%q) = %q, %v; want %q, %v", tc.head, host, ok, tc.host, tc.ok)
		}
	}
}
