package idleconn

import (
	"errors"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// counting counts the deadlines set on the connection under a Conn.
type counting struct {
	net.Conn
	reads, writes atomic.Int64
}

func (c *counting) SetReadDeadline(t time.Time) error {
	c.reads.Add(1)
	return c.Conn.SetReadDeadline(t)
}

func (c *counting) SetWriteDeadline(t time.Time) error {
	c.writes.Add(1)
	return c.Conn.SetWriteDeadline(t)
}

// TestDeadlinesInForceAreNotSetAgain: what net/http does to a connection
// per HTTP/1.1 request (a header deadline, none, a past one to stop its
// background read, none, the idle timeout, none) reaches the connection
// only where it changes the deadline in force.
func TestDeadlinesInForceAreNotSetAgain(t *testing.T) {
	_, server := testkit.TCPPair(t)
	under := &counting{Conn: server}
	c := Wrap(under, time.Minute)
	base := under.reads.Load()
	now := time.Now()
	for _, d := range []time.Time{now.Add(10 * time.Second), {}, time.Unix(1, 0), {}, now.Add(5 * time.Minute), {}} {
		if err := c.SetReadDeadline(d); err != nil {
			t.Fatal(err)
		}
	}
	// Set: the header deadline, back to idle, the past, back to idle.
	// Skipped: the server's idle timeout (later than ours: ours is in
	// force) and clearing it (ours still is).
	if got := under.reads.Load() - base; got != 4 {
		t.Errorf("%d read deadlines reached the connection, want 4", got)
	}
	w := under.writes.Load()
	for range 3 {
		c.SetWriteDeadline(time.Time{})
	}
	if got := under.writes.Load() - w; got != 0 {
		t.Errorf("%d write deadlines reached the connection for none that changed anything", got)
	}
}

// TestDeadlinesStillApply: skipping changes nothing of what a deadline
// does. An owner's deadline earlier than the idle one fires; a past one
// ends a read already waiting; clearing it lets reads wait again; and the
// idle timeout ends a silent connection.
func TestDeadlinesStillApply(t *testing.T) {
	client, server := testkit.TCPPair(t)
	c := Wrap(server, 300*time.Millisecond)
	buf := make([]byte, 1)

	c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	start := time.Now()
	if _, err := c.Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read past the owner's deadline: %v", err)
	}
	if time.Since(start) > 250*time.Millisecond {
		t.Fatalf("the owner's deadline fired after %v, later than itself", time.Since(start))
	}

	// A past deadline ends a read that is already waiting.
	c.SetReadDeadline(time.Time{})
	done := make(chan error, 1)
	go func() {
		_, err := c.Read(buf)
		done <- err
	}()
	time.Sleep(20 * time.Millisecond)
	c.SetReadDeadline(time.Unix(1, 0))
	select {
	case err := <-done:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("waiting read: %v", err)
		}
	case <-time.After(time.Second):
		t.Fatal("a past deadline did not end the waiting read")
	}

	// Cleared, a read waits for data again.
	c.SetReadDeadline(time.Time{})
	client.Write([]byte("x"))
	if _, err := c.Read(buf); err != nil || buf[0] != 'x' {
		t.Fatalf("read after clearing: %q, %v", buf, err)
	}

	// Silence past the idle timeout ends it, whatever the owner wants.
	c.SetReadDeadline(time.Now().Add(time.Hour))
	start = time.Now()
	if _, err := c.Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("silent read: %v", err)
	}
	if d := time.Since(start); d < 200*time.Millisecond || d > 2*time.Second {
		t.Fatalf("idle timeout fired after %v, want about 300ms", d)
	}
}
