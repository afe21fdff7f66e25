package fleettest

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// OutageDuringLoad: the store's server stopped under steady load on two
// instances costs savings, never requests; what goes upstream meanwhile
// says BYPASS; after a restart shared HITs resume within the store's
// Fleet.ResumeWithin; nothing leaks.
func OutageDuringLoad(t *testing.T, newFleet Factory) {
	// Registered first, so it runs after every other cleanup of the test.
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, ignore) })
	const interval = 400 * time.Millisecond
	f := newFleet(t, Options{Instances: 2, Killable: true, BreakerInterval: interval, BreakerFailures: 2, Dedup: dedup.Config{TTL: 30 * time.Second}},
		func(w http.ResponseWriter, r *http.Request) {
			time.Sleep(2 * time.Millisecond)
			fmt.Fprintf(w, "page %s", r.URL.RequestURI())
		})
	a, b := f.Insts[0], f.Insts[1]

	stop := Load(8, func(w, i int) Got {
		return f.Insts[(w+i)%2].Get(fmt.Sprintf("%s/load/%d", f.Origin.URL, i%50))
	})
	time.Sleep(300 * time.Millisecond)
	f.Kill()
	testkit.Eventually(t, testkit.Patience, func() bool { return !a.Available() && !b.Available() }, "breaker open on both instances")
	// The load's 50 pages sit in each instance's local tier by now; a page
	// nobody has fetched yet goes upstream alone, marked BYPASS.
	for i, inst := range f.Insts {
		g := inst.Get(fmt.Sprintf("%s/during/%d", f.Origin.URL, i))
		if g.Err != nil || g.Status != 200 || g.XCache != dedup.CacheBypass {
			t.Errorf("instance %d, new page while the store is down: %+v, want 200 BYPASS", i, g)
		}
	}
	time.Sleep(300 * time.Millisecond) // load while the store is down
	f.Restart()
	restarted := time.Now()
	// Shared HITs resume: a URL fetched on A is a HIT on B.
	testkit.Eventually(t, testkit.Patience, func() bool {
		u := fmt.Sprintf("%s/after/%d", f.Origin.URL, time.Now().UnixNano())
		if g := a.Get(u); g.XCache != dedup.CacheMiss {
			return false
		}
		return b.Get(u).XCache == dedup.CacheHit
	}, "shared HITs to resume")
	resumed := time.Since(restarted)
	counts, errs := stop()
	if len(errs) > 0 {
		t.Fatalf("%d client requests failed during the outage, first: %s", len(errs), errs[0])
	}
	t.Logf("X-Cache during the run: %v; shared HITs resumed %s after the restart", counts, resumed)
	if resumed > f.ResumeWithin {
		t.Fatalf("the shared layer took %s to come back (breaker interval %s)", resumed, interval)
	}
	for _, inst := range f.Insts {
		inst.Stop()
	}
}

// IdleInstanceFollowsTheStore: an instance without any traffic notices
// by itself that the store went away and that it came back, so /health
// (store_available) tells the truth. The log lines say how long each
// took.
func IdleInstanceFollowsTheStore(t *testing.T, newFleet Factory) {
	f := newFleet(t, Options{Instances: 1, Killable: true}, func(w http.ResponseWriter, r *http.Request) {})
	inst := f.Insts[0]
	if !inst.Available() {
		t.Fatal("not available at start")
	}
	f.Kill()
	killed := time.Now()
	testkit.Eventually(t, testkit.Patience, func() bool { return !inst.Available() }, "the idle instance to see the outage")
	t.Logf("idle instance noticed the outage after %s", time.Since(killed).Round(time.Millisecond))
	f.Restart()
	restarted := time.Now()
	testkit.Eventually(t, testkit.Patience, inst.Available, "the idle instance to see the store back")
	t.Logf("idle instance noticed the store back after %s", time.Since(restarted).Round(time.Millisecond))
}
