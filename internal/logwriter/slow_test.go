package logwriter

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// stuck is an output that blocks every write until released (a pipe
// nobody reads, a terminal scrolled back, a stalled log shipper).
type stuck struct {
	out
	release chan struct{}
	once    sync.Once
}

func (s *stuck) Write(p []byte) (int, error) {
	<-s.release
	return s.out.Write(p)
}

func (s *stuck) unblock() { s.once.Do(func() { close(s.release) }) }

// TestSlowOutputDoesNotBlockWriters: the goroutines that log (every
// request, with the access log on) never wait for the output. While it is
// stuck, what does not fit the buffer is dropped and counted, and once it
// moves again everything kept is written, whole lines in order. It used to
// write a full buffer on the logging goroutine, under the lock: one stuck
// output stalled every request.
func TestSlowOutputDoesNotBlockWriters(t *testing.T) {
	o := &stuck{release: make(chan struct{})}
	defer o.unblock()
	w := New(o, 64, time.Hour)
	const lines = 200
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range lines {
			fmt.Fprintf(w, "line %03d\n", i)
		}
	}()
	select {
	case <-done:
	case <-time.After(testkit.Patience):
		t.Fatal("writers blocked on a stuck output")
	}
	dropped := w.Dropped()
	if dropped == 0 {
		t.Fatal("nothing dropped, yet far more was written than the buffer holds")
	}
	o.unblock()
	w.Close()
	s, _ := o.get()
	got := strings.Split(strings.TrimSuffix(s, "\n"), "\n")
	if int64(len(got))+dropped != lines {
		t.Fatalf("%d lines written and %d dropped, want %d in all", len(got), dropped, lines)
	}
	last := -1
	for _, line := range got {
		var i int
		if _, err := fmt.Sscanf(line, "line %d", &i); err != nil || i <= last {
			t.Fatalf("line %q after line %d", line, last)
		}
		last = i
	}
}
