package idleconn

import (
	"errors"
	"io"
	"os"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestReadsDoNotHoldABlockedWrite: a peer that keeps sending a byte now and
// then but never reads makes no progress on the write side, and a write
// blocked on it must fail after the idle timeout. It used to wait for ever:
// every read moved the write deadline too, so a trickle of bytes (a blind
// tunnel's client, an HTTP/2 client sending PINGs while not reading its
// response) held the proxy's writer without bound.
func TestReadsDoNotHoldABlockedWrite(t *testing.T) {
	client, server := testkit.TCPPair(t)
	c := Wrap(server, 300*time.Millisecond)
	stop := make(chan struct{})
	defer close(stop)
	go func() { // the peer: a byte every 50 ms, nothing read
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			if _, err := client.Write([]byte("x")); err != nil {
				return
			}
		}
	}()
	go func() { // what the proxy reads of it
		buf := make([]byte, 1)
		for {
			if _, err := c.Read(buf); err != nil {
				return
			}
		}
	}()
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		_, err := c.Write(make([]byte, 64<<20)) // far past the socket buffers
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("blocked write: %v, want the idle deadline", err)
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Fatalf("blocked write failed after %v, want about 300ms", d)
		}
	case <-time.After(5 * time.Second):
		server.Close() // ends the write
		t.Fatal("a write to a peer that never reads was still blocked after 5s: its trickle of bytes kept moving the write deadline")
	}
}

// TestWritesKeepAWaitingReadAlive: a connection that carries a download
// (writes moving) while the peer has nothing to say is not idle: the read
// waiting meanwhile must not be cut. A one-way transfer longer than the
// timeout through a tunnel (a TLS download: the client sends nothing after
// its handshake) ends when that read fails, and net/http cancels a
// request whose background read fails.
func TestWritesKeepAWaitingReadAlive(t *testing.T) {
	client, server := testkit.TCPPair(t)
	c := Wrap(server, 300*time.Millisecond)
	go io.Copy(io.Discard, client) // the peer reads all, says nothing
	readErr := make(chan error, 1)
	go func() {
		_, err := c.Read(make([]byte, 1))
		readErr <- err
	}()
	for range 20 { // 1 s of writes, past the timeout
		if _, err := c.Write([]byte("x")); err != nil {
			t.Fatalf("write to a reading peer: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	select {
	case err := <-readErr:
		t.Fatalf("the read waiting beside a moving download failed: %v", err)
	default:
	}
}
