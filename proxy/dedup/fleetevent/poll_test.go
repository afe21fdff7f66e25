package fleetevent

import (
	"context"
	"errors"
	"slices"
	"sync/atomic"
	"testing"
	"time"
)

// TestPollWakesWhatTheCheckFinds: Poll asks about every key with
// waiters, wakes only the ones the check returns, and all of them when
// the check fails.
func TestPollWakesWhatTheCheckFinds(t *testing.T) {
	var w Waiters
	chans := map[string]chan struct{}{}
	for _, k := range []string{"a", "b", "c"} {
		chans[k] = w.Add(k, w.Mark(k))
	}
	var fail atomic.Bool
	asked := make(chan []string, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		w.Poll(ctx, time.Millisecond, func(_ context.Context, keys []string) ([]string, error) {
			select {
			case asked <- slices.Sorted(slices.Values(keys)):
			default:
			}
			if fail.Load() {
				return []string{"a"}, errors.New("store away")
			}
			return []string{"b"}, nil
		})
	}()
	defer func() { cancel(); <-done }()

	if got := <-asked; !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Fatalf("asked about %q, want every key with waiters", got)
	}
	woken := func(k string) bool {
		select {
		case <-chans[k]:
			return true
		case <-time.After(50 * time.Millisecond):
			return false
		}
	}
	if !woken("b") || woken("a") || woken("c") {
		t.Fatal("want b woken, and neither a nor c")
	}
	fail.Store(true)
	for _, k := range []string{"a", "b", "c"} {
		if !woken(k) {
			t.Fatalf("%s not woken by a failed check", k)
		}
	}
}
