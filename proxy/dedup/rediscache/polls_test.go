package rediscache

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
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
	var joins, renewals int
	for _, trip := range trips {
		for _, c := range trip {
			switch {
			case strings.Contains(c, "(join)"): // the tripLog names scripts
				joins++
			case strings.HasPrefix(c, "pexpire ") && strings.HasSuffix(strings.Fields(c)[1], "}:w"):
				renewals++
			}
		}
	}
	// Two trips a tick (the flights, then their holders' presence), with
	// room for ticks that bunch up on a loaded machine and for one look
	// by every waiter (a resubscription wakes them all); a poll per
	// waiter is 20 join scripts a tick.
	elapsed := time.Since(start)
	ticks := int(elapsed / poll)
	t.Logf("%d waits for %v: %d round trips, %d join scripts, %d renewals of a waiters flag", keys, elapsed.Round(time.Millisecond), len(trips), joins, renewals)
	if most := 2*(2*ticks+2) + keys; len(trips) > most || joins > keys {
		t.Errorf("%d waits cost %d round trips and %d join scripts in %v, want at most %d and %d",
			keys, len(trips), joins, elapsed.Round(time.Millisecond), most, keys)
	}
	// A flag is renewed every third of the lease, not at every poll
	// (ticks per flight: 20 here).
	if most := keys * (int(elapsed/(lease/3)) + 2); renewals > most || renewals < keys {
		t.Errorf("%d waits for %v renewed their waiters flags %d times, want %d to %d", keys, elapsed.Round(time.Millisecond), renewals, keys, most)
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

// TestFlagsKeptSchedule: a flag is due at first sight, then once every
// third of the lease, and a flight no longer polled leaves the schedule.
func TestFlagsKeptSchedule(t *testing.T) {
	k := flagsKept{every: time.Second, at: map[string]time.Time{}}
	t0 := time.Unix(1000, 0)
	steps := []struct {
		at   time.Duration
		tags []string
		want []bool
	}{
		{0, []string{"a", "b"}, []bool{true, true}},
		{100 * time.Millisecond, []string{"a", "b"}, []bool{false, false}},
		{900 * time.Millisecond, []string{"a"}, []bool{false}},
		{time.Second, []string{"a", "c"}, []bool{true, true}},
		{1500 * time.Millisecond, []string{"a", "c"}, []bool{false, false}},
		{2 * time.Second, []string{"a"}, []bool{true}},
	}
	for _, st := range steps {
		if got := k.due(st.tags, t0.Add(st.at)); !slices.Equal(got, st.want) {
			t.Fatalf("at %v, %v: due %v, want %v", st.at, st.tags, got, st.want)
		}
	}
	// b was last renewed at 0 and polled no more: gone once over two
	// periods old; a and c stay.
	k.due(nil, t0.Add(3*time.Second))
	if _, ok := k.at["b"]; ok || len(k.at) != 2 {
		t.Fatalf("schedule after pruning: %v, want a and c only", k.at)
	}
}
