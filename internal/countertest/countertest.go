// Package countertest is the contract test of ratelimit.Counter that the
// memory counter and every fleet store (Redis, PostgreSQL) run, the fleet
// stores against two of their instances. Only tests import it.
package countertest

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy/ratelimit"
)

// Agree checks two instances' counters of one store: requests racing on
// one key from both are admitted exactly up to the burst, wherever they
// come from; a refusal says how far ahead the key is and moves nothing;
// another key, and a key that is not text, have allowances of their own;
// the allowance comes back one interval at a time. Keys start with
// "gcra:".
func Agree(t *testing.T, a, b ratelimit.Counter) {
	t.Helper()
	ctx := context.Background()
	const interval, burst = 200 * time.Millisecond, 2 * time.Second // 10 at once
	var admitted atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for i := range 30 {
		c := a
		if i%2 == 1 {
			c = b
		}
		wg.Go(func() {
			ahead, ok, err := c.Take(ctx, "gcra:alice", interval, burst)
			switch {
			case err != nil:
				t.Error(err)
			case ok:
				admitted.Add(1)
				if ahead <= 0 || ahead > burst {
					t.Errorf("admitted %s ahead, want within (0, %s]", ahead, burst)
				}
			case ahead <= burst-interval || ahead > burst:
				t.Errorf("refused %s ahead, want within (%s, %s]", ahead, burst-interval, burst)
			}
		})
	}
	wg.Wait()
	// Each interval the race lasts earns one more: on a loaded machine 30
	// takes can outlast one. Two instances counting apart would admit 20.
	took := time.Since(start)
	if n, most := admitted.Load(), 10+int64(took/interval); n < 10 || n > most {
		t.Fatalf("%d of 30 racing requests admitted from two instances in %s, want the burst, 10, and one more per %s elapsed: at most %d", n, took.Round(time.Millisecond), interval, most)
	}
	for _, key := range []string{"gcra:bob", "gcra:\xff\x00"} {
		if _, ok, err := b.Take(ctx, key, interval, burst); err != nil || !ok {
			t.Errorf("%q after alice spent her burst: %v %v, want admitted", key, ok, err)
		}
	}
	// One interval later, one more fits, and then nothing.
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, ok, err := a.Take(ctx, "gcra:alice", interval, burst)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the allowance never came back")
		}
		time.Sleep(interval / 4)
	}
	if _, ok, err := b.Take(ctx, "gcra:alice", interval, burst); err != nil || ok {
		t.Fatalf("right after the interval's request: %v %v, want refused", ok, err)
	}
}
