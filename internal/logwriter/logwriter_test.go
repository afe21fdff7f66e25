package logwriter

import (
	"bytes"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// out counts the writes it gets.
type out struct {
	mu     sync.Mutex
	buf    bytes.Buffer
	writes int
}

func (o *out) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.writes++
	return o.buf.Write(p)
}

func (o *out) get() (string, int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.buf.String(), o.writes
}

// TestBatchesThenFlushes: lines written together leave in one write after
// the delay, in order, none lost.
func TestBatchesThenFlushes(t *testing.T) {
	o := &out{}
	w := New(o, 1<<16, 20*time.Millisecond)
	defer w.Close()
	var want strings.Builder
	for i := range 100 {
		line := fmt.Sprintf("line %d\n", i)
		want.WriteString(line)
		w.Write([]byte(line))
	}
	if s, n := o.get(); n != 0 || s != "" {
		t.Fatalf("before the delay: %d writes", n)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { s, _ := o.get(); return s == want.String() }, "the lines after the delay")
	if _, n := o.get(); n != 1 {
		t.Errorf("100 lines took %d writes, want 1", n)
	}
	// The next line arms the timer again.
	w.Write([]byte("late\n"))
	testkit.Eventually(t, testkit.Patience, func() bool { s, _ := o.get(); return strings.HasSuffix(s, "late\n") }, "a line written after a flush")
}

// TestFullBufferAndClose: a full buffer is written without waiting for
// the delay, a line larger than the buffer goes out after what waits, and
// Close writes the rest; nothing is reordered, and nothing is lost without
// being counted, with writers in parallel.
func TestFullBufferAndClose(t *testing.T) {
	o := &out{}
	w := New(o, 64, time.Hour)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 50 {
				fmt.Fprintf(w, "g%d-%02d\n", g, i)
			}
		})
	}
	wg.Wait()
	testkit.Eventually(t, testkit.Patience, func() bool { _, n := o.get(); return n > 0 }, "a full buffer written")
	w.Flush() // what waits, so that the long line is not dropped behind it
	big := strings.Repeat("x", 100) + "\n"
	w.Write([]byte(big))
	w.Write([]byte("tail\n"))
	w.Close()
	w.Write([]byte("after close\n"))
	s, _ := o.get()
	seen := 0
	for g := range 4 {
		last := -1
		for _, line := range strings.Split(s, "\n") {
			var gg, i int
			if _, err := fmt.Sscanf(line, "g%d-%d", &gg, &i); err == nil && gg == g {
				if i <= last {
					t.Fatalf("goroutine %d: line %d after %d", g, i, last)
				}
				last = i
				seen++
			}
		}
	}
	if d := w.Dropped(); int64(seen)+d != 200 {
		t.Fatalf("%d lines written, %d dropped, want 200 in all", seen, d)
	}
	if !strings.HasSuffix(s, big+"tail\nafter close\n") {
		t.Fatalf("end of output: %q", s[max(0, len(s)-200):])
	}
}
