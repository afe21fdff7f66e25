package workers

import (
	"context"
	"errors"
	"net/http"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// TestReuseAndStop: finished workers wait for the next function (no new
// goroutine), at most MaxIdle of them; Close ends them all.
func TestReuseAndStop(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	w := &Pool{MaxIdle: 2}
	var ran atomic.Int64
	var wg sync.WaitGroup
	block := make(chan struct{})
	for range 5 {
		wg.Add(1)
		w.Go(func() { defer wg.Done(); <-block; ran.Add(1) })
	}
	close(block)
	wg.Wait()
	// Five workers finished; two stay idle.
	waitIdle(w, 2)
	wg.Add(2)
	w.Go(func() { defer wg.Done(); ran.Add(1) })
	w.Go(func() { defer wg.Done(); ran.Add(1) })
	wg.Wait()
	waitIdle(w, 2)
	if n := ran.Load(); n != 7 {
		t.Fatalf("ran %d functions, want 7", n)
	}
	w.Close()
}

func waitIdle(w *Pool, n int) {
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

// TestDoRunsOnAWorker: Do returns once f has run, on a worker that stays
// for the next call, and its effects are visible to the caller.
func TestDoRunsOnAWorker(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	w := &Pool{MaxIdle: 1}
	defer w.Close()
	n := 0
	w.Do(func() { n++ })
	waitIdle(w, 1)
	w.Do(func() { n++ })
	if n != 2 {
		t.Fatalf("n = %d after two calls, want 2", n)
	}
	waitIdle(w, 1) // the same worker, back again: no second one was needed
}

// TestDoRaisesThePanicInTheCaller: a panic in f reaches Do's caller with
// its value (http.ErrAbortHandler must stay itself for net/http), and the
// worker survives it.
func TestDoRaisesThePanicInTheCaller(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	w := &Pool{MaxIdle: 1}
	defer w.Close()
	got := func() (r any) {
		defer func() { r = recover() }()
		w.Do(func() { panic(http.ErrAbortHandler) })
		return nil
	}()
	if err, ok := got.(error); !ok || !errors.Is(err, http.ErrAbortHandler) {
		t.Fatalf("recovered %v, want http.ErrAbortHandler", got)
	}
	waitIdle(w, 1)
	ran := false
	w.Do(func() { ran = true })
	if !ran {
		t.Fatal("the worker did not run the next function")
	}
}

// TestDoAfterClose runs f on the caller, and Go after Close panics rather
// than start a goroutine nobody waits for.
func TestDoAfterClose(t *testing.T) {
	w := &Pool{MaxIdle: 1}
	w.Close()
	ran := false
	w.Do(func() { ran = true })
	if !ran {
		t.Fatal("Do after Close did not run f")
	}
	defer func() {
		if recover() == nil {
			t.Fatal("Go after Close did not panic")
		}
	}()
	w.Go(func() {})
}

// TestWait: Wait returns once the group is done, or with the context's
// error when that ends first.
func TestWait(t *testing.T) {
	var wg sync.WaitGroup
	release := make(chan struct{})
	wg.Go(func() { <-release })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := Wait(ctx, &wg); err != context.DeadlineExceeded {
		t.Fatalf("Wait on a busy group = %v, want the deadline", err)
	}
	close(release)
	if err := Wait(context.Background(), &wg); err != nil {
		t.Fatalf("Wait on a group that finishes = %v", err)
	}
}
