package pgstore

import (
	"context"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/seed-a3c387e8/onceproxy/internal/countertest"
	"github.com/seed-a3c387e8/onceproxy/internal/fleettest"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/fleetevent"
)

// TestFleetStampede: 300 concurrent identical requests spread over three
// instances sharing one database reach the origin once.
func TestFleetStampede(t *testing.T) { fleettest.FleetStampede(t, contract(Config{}, nil)) }

// TestHitOnAnotherInstance: a page fetched through A is a HIT on B and C.
func TestHitOnAnotherInstance(t *testing.T) {
	fleettest.HitOnAnotherInstance(t, contract(Config{}, nil))
}

// TestLeaderSessionEndsTakeover: the leading instance's lock session
// ends mid-flight (what its process dying does): PostgreSQL drops the
// lock, a waiter on another instance takes over, and every client still
// gets an answer. The session reconnects for the leader's next flight.
func TestLeaderSessionEndsTakeover(t *testing.T) {
	var f *fleetFixture
	// One lock session: the next flight is on the one that ended.
	fleettest.LeaderGoneTakeover(t, contract(Config{FlightConns: 1}, &f), func(*fleettest.Instance) {
		// End the session that holds the flight's lock, as the death of
		// A's process would: that lock's holder only, not the sessions of
		// other packages' tests that share the database.
		lock := heldLock(t, f.insts[0].store)
		var ended int
		if err := f.conn().QueryRow(context.Background(), `SELECT count(pg_terminate_backend(pid)) FROM pg_locks
			WHERE locktype = 'advisory' AND granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			AND classid = (($1::bigint >> 32) & 4294967295)::oid AND objid = ($1::bigint & 4294967295)::oid AND objsubid = 1`,
			lock).Scan(&ended); err != nil || ended != 1 {
			t.Fatalf("ended %d lock-holding sessions (%v), want 1", ended, err)
		}
	}, 10*time.Second)
	a := f.insts[0]
	if g := a.get(f.origin.URL + "/after"); g.status != 200 || g.xcache != dedup.CacheMiss {
		t.Fatalf("A's next flight: %+v", g)
	}
	if n := a.store.unlocked.Load(); n != 0 {
		t.Fatalf("%d of A's flights led without the lock, want none: the session should reconnect", n)
	}
}

// TestFailedFlightAcrossFleet: a 500 reaches the waiters of that flight on
// every instance; nothing is cached; the next request gets a fresh flight.
func TestFailedFlightAcrossFleet(t *testing.T) {
	fleettest.FailedFlightAcrossFleet(t, contract(Config{}, nil))
}

// TestConnectionErrorSharedAcrossFleet: a transport failure is shared too.
func TestConnectionErrorSharedAcrossFleet(t *testing.T) {
	fleettest.ConnectionErrorSharedAcrossFleet(t, contract(Config{}, nil))
}

// TestInvalidationReachesTheFleet: invalidating on A drops B's local copy,
// by URL and by key.
func TestInvalidationReachesTheFleet(t *testing.T) {
	fleettest.InvalidationReachesTheFleet(t, contract(Config{}, nil))
}

func TestInvalidationReachesEveryDiskTier(t *testing.T) {
	fleettest.InvalidationReachesEveryDiskTier(t, contract(Config{}, nil))
}

func TestInvalidationDuringAFleetFlight(t *testing.T) {
	fleettest.InvalidationDuringAFleetFlight(t, contract(Config{}, nil))
}

// TestFleetStatsAddUp: per-day counters in the database sum every
// instance; an older day counts in the week, not today, and a day past
// the week not at all.
func TestFleetStatsAddUp(t *testing.T) {
	var f *fleetFixture
	fleettest.FleetStatsAddUp(t, contract(Config{}, &f))
	f.exec(`INSERT INTO {s}.stats (day, hit, miss) VALUES (current_date - 3, 5, 5), (current_date - 20, 100, 0)`)
	fs, err := f.insts[1].bus.FleetStats(context.Background())
	if err != nil || fs.Today.Requests != 4 || fs.Last7Days.Requests != 14 || fs.Days[3].Requests != 10 {
		t.Fatalf("with older days: %+v, %v", fs, err)
	}
}

// TestNotesReachTheOtherInstances: a note published by one instance
// reaches the others' handler for its topic, never its own.
func TestNotesReachTheOtherInstances(t *testing.T) {
	fleettest.NotesReachTheOtherInstances(t, contract(Config{}, nil))
}

// TestLastingNotesAreRecalled: a lasting note is kept until it expires,
// in the database's clock, and handed to instances that subscribe later.
func TestLastingNotesAreRecalled(t *testing.T) {
	fleettest.LastingNotesAreRecalled(t, contract(Config{}, nil))
}

// TestClaimIsExclusiveAcrossInstances: one instance at a time holds a
// claim; releasing it lets the next in; it lapses by itself. (On the
// shared server, which no test may stop: the claim with the database gone
// is not tried.)
func TestClaimIsExclusiveAcrossInstances(t *testing.T) {
	fleettest.ClaimIsExclusiveAcrossInstances(t, contract(Config{}, nil))
}

// TestTakeCountsFleetWide: one allowance spent by every instance, by the
// database's clock.
func TestTakeCountsFleetWide(t *testing.T) {
	f := newFleet(t, 2, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {})
	countertest.Agree(t, f.insts[0].bus, f.insts[1].bus)
}

// TestFlightEndWakesOnlyWhenWaitedOn: the end of a flight nobody waits
// for elsewhere notifies no instance; the end of one another instance
// waits on notifies once. (Every instance's listener hears every
// notification: a fleet of N would otherwise pay N wake-ups per miss.)
func TestFlightEndWakesOnlyWhenWaitedOn(t *testing.T) {
	release := make(chan struct{})
	arrived := make(chan struct{}, 1)
	f := newFleet(t, 2, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			arrived <- struct{}{}
			<-release
		}
		io.WriteString(w, "page "+r.URL.Path)
	})
	ctx := context.Background()
	channel := f.schema + "_events"
	listener := f.conn()
	if _, err := listener.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	a, b := f.insts[0], f.insts[1]
	alone := a.get(f.origin.URL + "/alone")
	if alone.xcache != dedup.CacheMiss {
		t.Fatalf("the miss nobody waits for: %+v", alone)
	}
	slowA := make(chan got, 1)
	go func() { slowA <- a.get(f.origin.URL + "/slow") }()
	<-arrived
	slowB := make(chan got, 1)
	go func() { slowB <- b.get(f.origin.URL + "/slow") }()
	waitFor(t, "B waiting on A's flight", func() bool { return b.store.fleetWaits.Load() == 1 })
	close(release)
	waited := <-slowA
	if g := <-slowB; g.xcache != dedup.CacheCoalesced {
		t.Fatalf("B: %+v", g)
	}
	// Notifications arrive in commit order: one sent now comes after
	// both flights' ends.
	if _, err := f.conn().Exec(ctx, "SELECT pg_notify($1, 'sentinel')", channel); err != nil {
		t.Fatal(err)
	}
	ends := map[string]int{}
	for {
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		n, err := listener.WaitForNotification(wctx)
		cancel()
		if err != nil {
			t.Fatalf("waiting for the sentinel: %v", err)
		}
		if n.Payload == "sentinel" {
			break
		}
		ends[n.Payload]++
	}
	if n := ends[fleetevent.Format(fleetevent.FlightEnded, alone.key)]; n != 0 {
		t.Errorf("the flight nobody waited for notified the fleet %d times, want 0", n)
	}
	if n := ends[fleetevent.Format(fleetevent.FlightEnded, waited.key)]; n != 1 {
		t.Errorf("the flight B waited on notified the fleet %d times, want 1 (heard: %v)", n, ends)
	}
}

// heldLock is the one flight lock st holds.
func heldLock(t *testing.T, st *Cache) int64 {
	t.Helper()
	st.held.mu.Lock()
	defer st.held.mu.Unlock()
	if len(st.held.m) != 1 {
		t.Fatalf("the instance holds %d flight locks, want 1", len(st.held.m))
	}
	for lock := range st.held.m {
		return lock
	}
	return 0
}
