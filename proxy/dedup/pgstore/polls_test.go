package pgstore

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestWaitersPollTogether: however many keys an instance waits on, its
// safety-net poll costs one statement per poll_interval, not one per
// waiter; and the waits still end with the leader's value.
func TestWaitersPollTogether(t *testing.T) {
	const keys = 20
	const poll = 50 * time.Millisecond
	release := make(chan struct{})
	var once sync.Once
	open := func() { once.Do(func() { close(release) }) }
	defer open()
	var arrived atomic.Int64
	f := newFleet(t, 2, Config{PollInterval: poll, StatsFlush: time.Hour, SweepInterval: time.Hour}, dedup.Config{},
		func(w http.ResponseWriter, r *http.Request) {
			arrived.Add(1)
			<-release
			io.WriteString(w, "page "+r.URL.Path)
		})
	a, b := f.insts[0], f.insts[1]
	url := func(i int) string { return fmt.Sprintf("%s/k%d", f.origin.URL, i) }
	resA, resB := make(chan got, keys), make(chan got, keys)
	for i := range keys {
		go func() { resA <- a.get(url(i)) }()
	}
	waitFor(t, "A leading every key", func() bool { return arrived.Load() == keys })
	for i := range keys {
		go func() { resB <- b.get(url(i)) }()
	}
	waitFor(t, "B waiting on every key", func() bool { return b.store.fleetWaits.Load() == keys })

	b.trace.take()
	start := time.Now()
	time.Sleep(10 * poll)
	stmts, _ := b.trace.take()
	// One statement a tick (one batch holds 20 keys), with room for
	// ticks that bunch up on a loaded machine and for one look by every
	// waiter (a listener that reconnects wakes them all); a poll per
	// waiter is 20 a tick, 200 here.
	if most := 2*int(time.Since(start)/poll) + 2 + keys; len(stmts) > most {
		t.Errorf("%d waits cost %d statements in %v, want at most %d (one per poll_interval):\n%s",
			keys, len(stmts), time.Since(start).Round(time.Millisecond), most, strings.Join(stmts, "\n"))
	}

	open()
	for range keys {
		if g := <-resA; g.err != nil || g.xcache != dedup.CacheMiss {
			t.Fatalf("leader: %+v", g)
		}
		if g := <-resB; g.err != nil || g.xcache != dedup.CacheCoalesced || !strings.HasPrefix(g.body, "page /k") {
			t.Fatalf("waiter: %+v", g)
		}
	}
	if arrived.Load() != keys {
		t.Fatalf("origin saw %d requests for %d keys", arrived.Load(), keys)
	}
}
