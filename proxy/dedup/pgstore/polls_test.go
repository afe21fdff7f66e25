package pgstore

import (
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fleettest"
)

// TestWaitersPollTogether: however many keys an instance waits on, its
// safety-net poll costs one statement per poll_interval, not one per
// waiter; and the waits still end with the leader's value.
func TestWaitersPollTogether(t *testing.T) {
	const keys = fleettest.PollKeys
	const poll = 50 * time.Millisecond
	var f *fleetFixture
	o := fleettest.Options{PollInterval: poll, StatsFlush: time.Hour}
	fleettest.WaitersPollTogether(t, contract(Config{SweepInterval: time.Hour}, &f), o, func() {
		b := f.insts[1]
		b.trace.take()
		start := time.Now()
		time.Sleep(10 * poll)
		stmts, _ := b.trace.take()
		// One statement a tick (one batch holds 20 keys), with room for
		// ticks that bunch up on a loaded machine and for one look by
		// every waiter (a listener that reconnects wakes them all); a
		// poll per waiter is 20 a tick, 200 here.
		if most := 2*int(time.Since(start)/poll) + 2 + keys; len(stmts) > most {
			t.Errorf("%d waits cost %d statements in %v, want at most %d (one per poll_interval):\n%s",
				keys, len(stmts), time.Since(start).Round(time.Millisecond), most, strings.Join(stmts, "\n"))
		}
	})
}
