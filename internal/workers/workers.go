// Package workers runs functions on goroutines that outlive one call.
//
// A goroutine starts with a small stack and grows it by copying, frame by
// frame, as calls go deeper. Work that runs deep (a fetch through the
// upstream pool, TLS and the mirrored client; a proxied request's handler)
// on a fresh goroutine each time pays that copy every time: about 5% of
// the miss path's CPU for the flights, and 4–6% on HTTP/2, where net/http
// starts a goroutine for every stream. A worker keeps the stack it grew
// and waits for the next function.
//
// Written here because the pools that exist (ants, tunny, errgroup's
// SetLimit) bound concurrency or queue work; this one only reuses
// goroutines, never makes a caller wait for a free one, and keeps at most
// MaxIdle waiting.
package workers

import (
	"context"
	"sync"
)

// Pool runs functions on reused goroutines. An idle worker waits for the
// next function; beyond MaxIdle idle ones, a worker that finishes ends,
// so a burst leaves no more goroutines behind than that. The zero value
// keeps no worker idle.
type Pool struct {
	MaxIdle int

	mu     sync.Mutex
	idle   []chan job // idle workers, each waiting on its own channel
	closed bool
	wg     sync.WaitGroup // every worker goroutine
}

// Go runs f on an idle worker, or on a new one, and returns at once. It
// must not be called after Close.
func (w *Pool) Go(f func()) {
	if !w.start(job{f: f}) {
		panic("workers: Go after Close")
	}
}

// job is a function for a worker, and for Do the call waiting for it.
type job struct {
	f func()
	c *call
}

// call is what Do's caller waits on, pooled: Do runs for every HTTP/2
// request, and a channel apiece would be one more allocation each.
type call struct {
	done  chan struct{}
	panic any // recovered from f; nil if it returned
}

var calls = sync.Pool{New: func() any { return &call{done: make(chan struct{}, 1)} }}

// start hands j to a worker, or returns false once the pool is closed.
func (w *Pool) start(j job) bool {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return false
	}
	if n := len(w.idle); n > 0 {
		ch := w.idle[n-1]
		w.idle = w.idle[:n-1]
		w.mu.Unlock()
		ch <- j // buffered: never blocks
		return true
	}
	w.wg.Add(1)
	w.mu.Unlock()
	go w.loop(j)
	return true
}

// Do runs f on a worker and returns when f has. A panic in f is
// recovered on the worker and raised again in the caller, with the same
// value, so that a caller's recovery (net/http's for a handler, and its
// http.ErrAbortHandler) works as if f had run there. A stack trace taken
// there is the caller's: code that wants f's own recovers inside f (the
// proxy's handler does, and logs it). After Close, f runs on the caller's
// goroutine.
func (w *Pool) Do(f func()) {
	c := calls.Get().(*call)
	if !w.start(job{f: f, c: c}) {
		calls.Put(c)
		f()
		return
	}
	<-c.done
	p := c.panic
	c.panic = nil
	calls.Put(c)
	if p != nil {
		panic(p)
	}
}

// run runs j's function and, for Do, hands its caller a panic instead of
// dying of it.
func (j job) run() {
	if j.c == nil {
		j.f()
		return
	}
	defer func() {
		j.c.panic = recover()
		j.c.done <- struct{}{}
	}()
	j.f()
}

func (w *Pool) loop(j job) {
	defer w.wg.Done()
	ch := make(chan job, 1)
	for {
		j.run()
		w.mu.Lock()
		if w.closed || len(w.idle) >= w.MaxIdle {
			w.mu.Unlock()
			return
		}
		w.idle = append(w.idle, ch)
		w.mu.Unlock()
		var ok bool
		if j, ok = <-ch; !ok {
			return
		}
	}
}

// Close ends the idle workers and waits for every worker, busy ones
// included, to end.
func (w *Pool) Close() { _ = w.Stop(context.Background()) }

// Stop ends the idle workers and waits until the busy ones have finished
// their functions, or ctx is done: then it returns ctx's error, and the
// busy workers end as their functions return.
func (w *Pool) Stop(ctx context.Context) error {
	w.mu.Lock()
	w.closed = true
	for _, ch := range w.idle {
		close(ch)
	}
	w.idle = nil
	w.mu.Unlock()
	return Wait(ctx, &w.wg)
}

// Wait waits for wg until ctx ends, and then returns ctx's error: a
// shutdown that waits for goroutines it owns, within its grace. The
// goroutine that waits for wg outlives an early return only until wg is
// done.
func Wait(ctx context.Context, wg *sync.WaitGroup) error {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
