package fleettest

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// PollKeys is how many keys WaitersPollTogether waits on at once.
const PollKeys = 20

// WaitersPollTogether: with instance A leading PollKeys flights that take
// their time and instance B waiting on every one of them, measure (the
// store's own count of what B's waits cost it, polled every
// Options.PollInterval) runs; then the waits end with the leader's value,
// each key fetched once. A store's measure checks that its safety-net poll
// costs per interval, not per waiter.
func WaitersPollTogether(t *testing.T, newFleet Factory, o Options, measure func()) {
	release := make(chan struct{})
	var once sync.Once
	open := func() { once.Do(func() { close(release) }) }
	defer open() // a failure must not leave the origin's handler (and Close) waiting
	var arrived atomic.Int64
	o.Instances = 2
	f := newFleet(t, o, func(w http.ResponseWriter, r *http.Request) {
		arrived.Add(1)
		<-release
		io.WriteString(w, "page "+r.URL.Path)
	})
	a, b := f.Insts[0], f.Insts[1]
	url := func(i int) string { return fmt.Sprintf("%s/k%d", f.Origin.URL, i) }
	resA, resB := make(chan Got, PollKeys), make(chan Got, PollKeys)
	for i := range PollKeys {
		go func() { resA <- a.Get(url(i)) }()
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return arrived.Load() == PollKeys }, "A leading every key")
	for i := range PollKeys {
		go func() { resB <- b.Get(url(i)) }()
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return b.FleetWaits() == PollKeys }, "B waiting on every key")

	measure()

	open()
	for range PollKeys {
		if g := <-resA; g.Err != nil || g.XCache != dedup.CacheMiss {
			t.Fatalf("leader: %+v", g)
		}
		if g := <-resB; g.Err != nil || g.XCache != dedup.CacheCoalesced || !strings.HasPrefix(g.Body, "page /k") {
			t.Fatalf("waiter: %+v", g)
		}
	}
	if arrived.Load() != PollKeys {
		t.Fatalf("origin saw %d requests for %d keys", arrived.Load(), PollKeys)
	}
}
