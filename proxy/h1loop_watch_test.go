package proxy

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/capture"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// leanPair serves the server end of a loopback TCP connection with a lean
// loop whose handler is handle, and returns the client end.
func leanPair(t *testing.T, handle func(w http.ResponseWriter, r *http.Request)) net.Conn {
	t.Helper()
	client, server := testkit.TCPPair(t)
	s := &Server{cfg: Config{ReadHeaderTimeout: 10 * time.Second, IdleTimeout: time.Minute},
		logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	loop := &h1Loop{
		plain:   func(*http.Request) bool { return true },
		handle:  handle,
		handOff: func(c *tappedConn) { c.Close() },
		base:    func(*tappedConn) context.Context { return context.Background() },
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.serveH1(loop, &tappedConn{Conn: capture.NewConn(server, nil)})
	}()
	t.Cleanup(func() {
		client.Close()
		<-done
	})
	_ = client.SetDeadline(time.Now().Add(15 * time.Second))
	return client
}

// TestWatchKeepsAWaitingClient: a request that waits (on a flight,
// say) well past watchAfter while its client waits too is not cancelled,
// whether it is the connection's first request or a later one.
func TestWatchKeepsAWaitingClient(t *testing.T) {
	var cancelled atomic.Int64
	c := leanPair(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
			cancelled.Add(1)
			http.Error(w, "gone", http.StatusBadGateway)
		case <-time.After(300 * time.Millisecond):
			io.WriteString(w, "ok")
		}
	})
	br := bufio.NewReader(c)
	for i := range 4 {
		fmt.Fprintf(c, "GET /%d HTTP/1.1\r\nHost: a\r\n\r\n", i)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 || string(b) != "ok" {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, b)
		}
	}
	if n := cancelled.Load(); n != 0 {
		t.Fatalf("%d requests cancelled while their client waited", n)
	}
}

// TestWatchRaces: requests that end right about when their watch
// starts, sequential and pipelined, are neither cancelled nor mixed up.
func TestWatchRaces(t *testing.T) {
	var cancelled, served atomic.Int64
	c := leanPair(t, func(w http.ResponseWriter, r *http.Request) {
		served.Add(1)
		d := watchAfter - 5*time.Millisecond + time.Duration(served.Load()%10)*time.Millisecond
		select {
		case <-r.Context().Done():
			cancelled.Add(1)
			http.Error(w, "gone", http.StatusBadGateway)
		case <-time.After(d):
			io.WriteString(w, r.URL.Path)
		}
	})
	br := bufio.NewReader(c)
	const n = 24
	for i := range n {
		fmt.Fprintf(c, "GET /%d HTTP/1.1\r\nHost: a\r\n\r\n", i)
		if i%3 == 0 {
			// and one more behind it, pipelined, later
			continue
		}
		for {
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != 200 {
				t.Fatalf("request %d: %d %q", i, resp.StatusCode, b)
			}
			if string(b) == fmt.Sprintf("/%d", i) {
				break
			}
		}
	}
	if n := cancelled.Load(); n != 0 {
		t.Fatalf("%d requests cancelled while their client waited", n)
	}
}

// TestClientLeavesMidResponse: a client that hangs up while its
// response streams ends the handler's writes with an error, and the loop.
func TestClientLeavesMidResponse(t *testing.T) {
	wrote := make(chan error, 1)
	c := leanPair(t, func(w http.ResponseWriter, r *http.Request) {
		fw := streamTo(w)
		piece := make([]byte, 32<<10)
		for range 10000 {
			if _, err := fw.Write(piece); err != nil {
				wrote <- err
				return
			}
		}
		wrote <- nil
	})
	fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: a\r\n\r\n")
	buf := make([]byte, 1000)
	if _, err := io.ReadFull(c, buf); err != nil {
		t.Fatal(err)
	}
	c.(*net.TCPConn).SetLinger(0)
	c.Close()
	select {
	case err := <-wrote:
		if err == nil {
			t.Fatal("every write succeeded after the client left")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the handler still writes 10s after its client left")
	}
}
