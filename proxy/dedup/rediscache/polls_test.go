package rediscache

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestWaitersPollTogether: however many flights an instance waits on,
// its safety-net poll is one round trip per poll_interval (two when a
// lock names a holder whose presence it checks), not a join script per
// waiter; the waits still end with the leader's value, after the lease
// would have dropped a waiters flag nobody kept alive.
func TestWaitersPollTogether(t *testing.T) {
	const keys = 20
	const poll, lease = 50 * time.Millisecond, 800 * time.Millisecond
	release := make(chan struct{})
	var once sync.Once
	open := func() { once.Do(func() { close(release) }) }
	defer open()
	var arrived atomic.Int64
	f := newFleet(t, 2, Config{PollInterval: poll, Lease: lease, StatsFlush: time.Hour}, dedup.Config{},
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
	testkit.Eventually(t, testkit.Patience, func() bool { return arrived.Load() == keys }, "A leading every key")
	for i := range keys {
		go func() { resB <- b.get(url(i)) }()
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return b.store.fleetWaits.Load() == keys }, "B waiting on every key")

	log := &tripLog{}
	b.store.rdb.AddHook(log)
	start := time.Now()
	time.Sleep(lease + 4*poll) // past a waiters flag nobody renews
	trips := log.snapshot().trips
	var joins int
	for _, trip := range trips {
		for _, c := range trip {
			if strings.Contains(c, "(join)") { // the tripLog names scripts
				joins++
			}
		}
	}
	// Two trips a tick (the flights, then their holders' presence), with
	// room for ticks that bunch up on a loaded machine and for one look
	// by every waiter (a resubscription wakes them all); a poll per
	// waiter is 20 join scripts a tick.
	ticks := int(time.Since(start) / poll)
	t.Logf("%d waits for %v: %d round trips, %d join scripts", keys, time.Since(start).Round(time.Millisecond), len(trips), joins)
	if most := 2*(2*ticks+2) + keys; len(trips) > most || joins > keys {
		t.Errorf("%d waits cost %d round trips and %d join scripts in %v, want at most %d and %d",
			keys, len(trips), joins, time.Since(start).Round(time.Millisecond), most, keys)
	}

	// Every flight's waiters flag outlived the lease: the leader's end
	// still sends the completion message.
	opts, err := redis.ParseURL(f.redis.URL)
	if err != nil {
		t.Fatal(err)
	}
	rc := redis.NewClient(opts)
	defer rc.Close()
	if flags, err := rc.Keys(context.Background(), "*}:w").Result(); err != nil || len(flags) != keys {
		t.Errorf("%d waiters flags after the lease (%v), want %d", len(flags), err, keys)
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
