// Package bindingstest is the contract test of upstream.Bindings that
// every fleet store (Redis, PostgreSQL) runs against two of its instances.
// Only tests import it.
package bindingstest

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// Agree checks two instances' bindings of one store: instances racing to
// bind one sticky key all get the first proposal; a move from the bound
// session wins once and a move from a stale one gets the current binding;
// a binding ends with its TTL, renewed by every Bind. Keys start with
// "bind:".
func Agree(t *testing.T, a, b upstream.Bindings) {
	t.Helper()
	ctx := context.Background()
	var wg sync.WaitGroup
	got := make(chan string, 40)
	for i := range 40 {
		bus := a
		if i%2 == 1 {
			bus = b
		}
		wg.Go(func() {
			id, err := bus.Bind(ctx, "bind:k1", fmt.Sprintf("s%d", i), time.Minute)
			if err != nil {
				t.Error(err)
			}
			got <- id
		})
	}
	wg.Wait()
	close(got)
	first := ""
	for id := range got {
		if first == "" {
			first = id
		}
		if id != first {
			t.Fatalf("racing binds got %q and %q", first, id)
		}
	}
	// Two instances move the key away from its cooling session at once:
	// one wins, the other learns where it went.
	moved := make(chan string, 2)
	for i, bus := range []upstream.Bindings{a, b} {
		wg.Go(func() {
			id, err := bus.Rebind(ctx, "bind:k1", first, fmt.Sprintf("new%d", i), time.Minute)
			if err != nil {
				t.Error(err)
			}
			moved <- id
		})
	}
	wg.Wait()
	m1, m2 := <-moved, <-moved
	if m1 != m2 || (m1 != "new0" && m1 != "new1") {
		t.Fatalf("racing moves ended on %q and %q", m1, m2)
	}
	if id, _ := a.Bind(ctx, "bind:k1", "other", time.Minute); id != m1 {
		t.Fatalf("after the move Bind says %q, want %q", id, m1)
	}
	// A stale move (from a session the key left) changes nothing.
	if id, _ := b.Rebind(ctx, "bind:k1", first, "late", time.Minute); id != m1 {
		t.Fatalf("stale move: %q, want %q", id, m1)
	}
	// TTL: a binding not renewed ends; a new proposal takes the key.
	if id, _ := a.Bind(ctx, "bind:k2", "short", 200*time.Millisecond); id != "short" {
		t.Fatalf("bind k2: %q", id)
	}
	// (Every Bind renews: look only once it has surely expired.)
	time.Sleep(500 * time.Millisecond)
	if id, _ := b.Bind(ctx, "bind:k2", "later", time.Minute); id != "later" {
		t.Fatalf("an expired binding still holds: %q", id)
	}
}
