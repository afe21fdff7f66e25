package dedup

import "sync"

// workers run flights on goroutines that outlive one flight. A fetch
// grows a deep stack (the upstream pool, TLS, the mirrored client); a
// fresh goroutine per miss grew it anew each time, copying it a few times
// on the way (about 5% of the miss path's CPU). An idle worker waits for
// the next flight; beyond maxIdle idle ones, a worker that finishes ends,
// so a burst leaves no more goroutines behind than that.
type workers struct {
	maxIdle int

	mu     sync.Mutex
	idle   []chan func() // idle workers, each waiting on its own channel
	closed bool
	wg     sync.WaitGroup // every worker goroutine
}

// run runs f on an idle worker, or on a new one. It must not be called
// after close.
func (w *workers) run(f func()) {
	w.mu.Lock()
	if n := len(w.idle); n > 0 {
		ch := w.idle[n-1]
		w.idle = w.idle[:n-1]
		w.mu.Unlock()
		ch <- f // buffered: never blocks
		return
	}
	w.wg.Add(1)
	w.mu.Unlock()
	go w.loop(f)
}

func (w *workers) loop(f func()) {
	defer w.wg.Done()
	ch := make(chan func(), 1)
	for {
		f()
		w.mu.Lock()
		if w.closed || len(w.idle) >= w.maxIdle {
			w.mu.Unlock()
			return
		}
		w.idle = append(w.idle, ch)
		w.mu.Unlock()
		var ok bool
		if f, ok = <-ch; !ok {
			return
		}
	}
}

// close ends the idle workers and waits for every worker, busy ones
// included, to end.
func (w *workers) close() {
	w.mu.Lock()
	w.closed = true
	for _, ch := range w.idle {
		close(ch)
	}
	w.idle = nil
	w.mu.Unlock()
	w.wg.Wait()
}
