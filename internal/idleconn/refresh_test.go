package idleconn

import (
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestShortTimeoutKeepsBusyConnOpen: with an idle timeout shorter than the
// refresh slack (fleet.peer_idle_timeout and the tests' own take any
// positive value), a connection moving a byte every 100 ms is not idle and
// must not be cut. It used to be: the deadline moved at most once a second,
// so a 600 ms timeout fired 600 ms after the first read, traffic or not.
func TestShortTimeoutKeepsBusyConnOpen(t *testing.T) {
	client, server := testkit.TCPPair(t)
	c := Wrap(server, 600*time.Millisecond)
	const n = 15 // 1.5 s of traffic, well past the timeout
	go func() {
		for range n {
			if _, err := client.Write([]byte("x")); err != nil {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	buf := make([]byte, 1)
	for i := range n {
		if _, err := c.Read(buf); err != nil {
			t.Fatalf("read %d of a connection moving a byte every 100ms: %v", i, err)
		}
	}
}
