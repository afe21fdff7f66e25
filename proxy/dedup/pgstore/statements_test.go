package pgstore

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fleettest"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// The statement budget per request, as this package's README section
// states it: round trips (a statement alone or one pipelined batch) and
// statements. Connections are warm (prepared statements cached); a pooled
// connection idle for more than a second adds pgxpool's ping.
var budget = map[string]struct{ roundTrips, statements int }{
	// read-or-lock (the engine reads only the memory tier before a
	// flight), and one batch: BEGIN, store (and notify, when a waiter
	// marked the flight), COMMIT, unlock.
	dedup.CacheMiss: {2, 5},
	// read-or-lock finds the value (which then sits in the memory tier for
	// local_ttl).
	dedup.CacheHit: {1, 1},
	// read-or-lock (the lock is held elsewhere), the mark that makes the
	// leader's end wake the fleet, and one re-check after the leader's
	// notification; without one, the instance's poll adds one statement
	// per poll_interval for all its waits (TestWaitersPollTogether).
	dedup.CacheCoalesced: {3, 3},
}

// TestStatementsPerRequest counts, with a tracer on the connections, what
// a MISS, a HIT from another instance's fetch and a COALESCED wait cost,
// and fails above the budget.
func TestStatementsPerRequest(t *testing.T) {
	release := make(chan struct{}, 1)
	arrived := make(chan struct{}, 1)
	var hold atomic.Bool
	f := newFleet(t, 2, Config{PollInterval: time.Minute, StatsFlush: time.Hour, SweepInterval: time.Hour}, dedup.Config{},
		func(w http.ResponseWriter, r *http.Request) {
			if hold.Load() {
				arrived <- struct{}{}
				<-release
			}
			io.WriteString(w, "page "+r.URL.Path)
		})
	a, b := f.insts[0], f.insts[1]
	check := func(inst *instance, want string, g got) {
		t.Helper()
		stmts, rts := inst.trace.take()
		if g.err != nil || g.status != 200 || g.xcache != want {
			t.Fatalf("%s: %+v, want %s", inst.name, g, want)
		}
		limit := budget[want]
		t.Logf("%s: %d round trips, %d statements: %s", want, rts, len(stmts), strings.Join(stmts, " | "))
		if rts > limit.roundTrips || len(stmts) > limit.statements {
			t.Errorf("%s cost %d round trips and %d statements, budget %d and %d:\n%s",
				want, rts, len(stmts), limit.roundTrips, limit.statements, strings.Join(stmts, "\n"))
		}
	}
	// Warm every connection's statement cache (preparing is not counted,
	// but a first use must not hide among the requests counted).
	for i := range 4 {
		u := f.origin.URL + "/warm/" + string(rune('a'+i))
		a.get(u)
		b.get(u)
	}
	a.trace.take()
	b.trace.take()

	check(a, dedup.CacheMiss, a.get(f.origin.URL+"/miss"))
	check(b, dedup.CacheHit, b.get(f.origin.URL+"/miss"))
	if g := b.get(f.origin.URL + "/miss"); g.xcache != dedup.CacheHit {
		t.Fatalf("from the memory tier: %+v", g)
	}
	if stmts, _ := b.trace.take(); len(stmts) != 0 {
		t.Errorf("a HIT from the memory tier cost statements: %q", stmts)
	}

	// COALESCED: B waits on A's flight.
	hold.Store(true)
	resA := make(chan got, 1)
	go func() { resA <- a.get(f.origin.URL + "/coalesced") }()
	<-arrived // A leads
	resB := make(chan got, 1)
	go func() { resB <- b.get(f.origin.URL + "/coalesced") }()
	waitFor(t, "B waiting on A's flight", func() bool { return b.store.fleetWaits.Load() == 1 })
	release <- struct{}{}
	check(b, dedup.CacheCoalesced, <-resB)
	check(a, dedup.CacheMiss, <-resA)
}

// TestConcurrentLookupsShareOneSelect: a stampede of lookups on one
// instance reads a stored value with one statement, not one per client.
func TestConcurrentLookupsShareOneSelect(t *testing.T) {
	var f *fleetFixture
	ctx := context.Background()
	stall := func() func() {
		// Slow the SELECT down: a table lock that blocks readers until
		// the rollback.
		tx, err := f.conn().Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tx.Rollback(ctx) })
		if _, err := tx.Exec(ctx, schemaSQL(f.schema, "LOCK TABLE {s}.cache IN ACCESS EXCLUSIVE MODE")); err != nil {
			t.Fatal(err)
		}
		f.insts[0].trace.take()
		return func() { tx.Rollback(ctx) }
	}
	statements := func() (int, string) {
		stmts, _ := f.insts[0].trace.take()
		return len(stmts), strings.Join(stmts, "\n")
	}
	fleettest.ConcurrentLookupsShareOneRead(t, contract(Config{StatsFlush: time.Hour, SweepInterval: time.Hour}, &f), stall, statements)
}
