package rediscache

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/seed-a3c387e8/onceproxy/internal/fleettest"
)

// TestWaitersPollTogether: however many flights an instance waits on,
// its safety-net poll is one round trip per poll_interval (two when a
// lock names a holder whose presence it checks), not a join script per
// waiter; the waits still end with the leader's value, after the lease
// would have dropped a waiters flag nobody kept alive.
func TestWaitersPollTogether(t *testing.T) {
	const keys = fleettest.PollKeys
	const poll, lease = 50 * time.Millisecond, 800 * time.Millisecond
	var f *fleetFixture
	o := fleettest.Options{PollInterval: poll, StatsFlush: time.Hour}
	fleettest.WaitersPollTogether(t, contract(Config{Lease: lease}, &f), o, func() {
		log := &tripLog{}
		f.insts[1].store.rdb.AddHook(log)
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
		// Two trips a tick (the flights, then their holders' presence),
		// with room for ticks that bunch up on a loaded machine and for
		// one look by every waiter (a resubscription wakes them all); a
		// poll per waiter is 20 join scripts a tick.
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
	})
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
