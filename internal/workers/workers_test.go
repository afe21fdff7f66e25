package dedup

import (
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"go.uber.org/goleak"
)

// TestWorkersReuseAndStop: finished workers wait for the next job (no new
// goroutine), at most maxIdle of them; close ends them all.
func TestWorkersReuseAndStop(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	w := &workers{maxIdle: 2}
	var ran atomic.Int64
	var wg sync.WaitGroup
	block := make(chan struct{})
	for range 5 {
		wg.Add(1)
		w.run(func() { defer wg.Done(); <-block; ran.Add(1) })
	}
	close(block)
	wg.Wait()
	// Five workers finished; two stay idle.
	waitIdle := func(n int) {
		for {
			w.mu.Lock()
			got := len(w.idle)
			w.mu.Unlock()
			if got == n {
				return
			}
			runtime.Gosched()
		}
	}
	waitIdle(2)
	wg.Add(2)
	w.run(func() { defer wg.Done(); ran.Add(1) })
	w.run(func() { defer wg.Done(); ran.Add(1) })
	wg.Wait()
	waitIdle(2)
	if n := ran.Load(); n != 7 {
		t.Fatalf("ran %d jobs, want 7", n)
	}
	w.close()
}
