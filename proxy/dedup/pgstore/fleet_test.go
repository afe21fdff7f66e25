package pgstore

import (
	"context"
	"io"
	"math"
	"net/http"
	"sync"
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
	release := make(chan struct{})
	var once sync.Once
	open := func() { once.Do(func() { close(release) }) }
	defer open() // a failure must not leave the origin's handler (and Close) waiting
	arrived := make(chan struct{}, 4)
	// One lock session: the next flight is on the one that ended.
	f := newFleet(t, 2, Config{FlightConns: 1}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/crash" {
			arrived <- struct{}{}
			<-release
		}
		io.WriteString(w, "answer")
	})
	a, b := f.insts[0], f.insts[1]
	resA := make(chan got, 1)
	go func() { resA <- a.get(f.origin.URL + "/crash") }()
	<-arrived // A leads and is fetching
	const n = 5
	resB := make(chan got, n)
	for range n {
		go func() { resB <- b.get(f.origin.URL + "/crash") }()
	}
	waitFor(t, "B's clients waiting on A's flight", func() bool {
		return b.engine.Stats().Waiters == n && b.store.fleetWaits.Load() == 1
	})
	// End the session that holds the flight's lock, as the death of A's
	// process would: that lock's holder only, not the sessions of other
	// packages' tests that share the database.
	lock := heldLock(t, a.store)
	c := f.conn()
	var ended int
	if err := c.QueryRow(context.Background(), `SELECT count(pg_terminate_backend(pid)) FROM pg_locks
		WHERE locktype = 'advisory' AND granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		AND classid = (($1::bigint >> 32) & 4294967295)::oid AND objid = ($1::bigint & 4294967295)::oid AND objsubid = 1`,
		lock).Scan(&ended); err != nil || ended != 1 {
		t.Fatalf("ended %d lock-holding sessions (%v), want 1", ended, err)
	}
	select {
	case <-arrived: // B took over
	case <-time.After(10 * time.Second):
		t.Fatal("no instance took over the dead leader's flight")
	}
	open()
	for range n {
		if g := <-resB; g.err != nil || g.status != 200 || g.body != "answer" {
			t.Fatalf("B client: %+v", g)
		}
	}
	if g := <-resA; g.err != nil || g.status != 200 {
		t.Fatalf("A client: %+v", g)
	}
	if f.hits.Load() != 2 {
		t.Fatalf("origin saw %d requests, want 2 (the dead leader's and the takeover)", f.hits.Load())
	}
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

// fleetPrices price the fleet fixture's savings.
var fleetPrices = dedup.SavingsConfig{PricePer1000Requests: 2, PricePerGB: 8}

// TestFleetStatsAddUp: per-day counters in the database sum every
// instance.
func TestFleetStatsAddUp(t *testing.T) {
	f := newFleet(t, 2, Config{StatsFlush: 20 * time.Millisecond}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "0123456789")
	})
	a, b := f.insts[0], f.insts[1]
	a.get(f.origin.URL + "/s") // MISS
	b.get(f.origin.URL + "/s") // HIT (10 bytes avoided)
	b.get(f.origin.URL + "/s") // HIT
	a.get(f.origin.URL + "/t") // MISS
	var fs dedup.FleetStats
	waitFor(t, "stats flushed", func() bool {
		var err error
		fs, err = a.bus.FleetStats(context.Background())
		return err == nil && fs.Today.Requests == 4
	})
	d := fs.Today
	if d.XCache["HIT"] != 2 || d.XCache["MISS"] != 2 || d.BySource["dedup_cache"] != 2 || d.SavingsPct != 50 || d.BytesAvoided != 20 {
		t.Fatalf("today: %+v", d)
	}
	// Two HITs of 10 bytes at 2 per 1,000 requests and 8 per GB.
	if want := 2 * (2.0/1000 + 10*8/1e9); math.Abs(d.MoneySaved-want) > 1e-12 {
		t.Fatalf("money saved today %v, want %v", d.MoneySaved, want)
	}
	if fs.Last7Days.Requests != 4 || len(fs.Days) != statsDays || fs.Store != "postgres" || !fs.Available {
		t.Fatalf("7 days: %+v", fs)
	}
	// An older day counts in the week, not today; a day past the week not
	// at all.
	f.exec(`INSERT INTO {s}.stats (day, hit, miss) VALUES (current_date - 3, 5, 5), (current_date - 20, 100, 0)`)
	fs, err := b.bus.FleetStats(context.Background())
	if err != nil || fs.Today.Requests != 4 || fs.Last7Days.Requests != 14 || fs.Days[3].Requests != 10 {
		t.Fatalf("with older days: %+v, %v", fs, err)
	}
}

// TestNotesReachTheOtherInstances: a note published by one instance
// reaches the others' handler for its topic, never its own.
func TestNotesReachTheOtherInstances(t *testing.T) {
	f := newFleet(t, 2, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {})
	a, b := f.insts[0], f.insts[1]
	var mu sync.Mutex
	heard := map[string][]string{}
	for _, inst := range f.insts {
		inst.bus.Subscribe("session", func(msg string, _ time.Duration) {
			mu.Lock()
			heard[inst.name] = append(heard[inst.name], msg)
			mu.Unlock()
		})
	}
	received := func(name string) []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), heard[name]...)
	}
	// The listener may take a moment to be live: publish until heard.
	waitFor(t, "b to hear a", func() bool {
		a.bus.Publish("other", "", "not for session handlers", 0)
		a.bus.Publish("session", "", `{"session":"s1","kind":"cooldown"}`, 0)
		time.Sleep(20 * time.Millisecond)
		return len(received(b.name)) > 0
	})
	for _, m := range received(b.name) {
		if m != `{"session":"s1","kind":"cooldown"}` {
			t.Errorf("b heard %q", m)
		}
	}
	if m := received(a.name); len(m) != 0 {
		t.Errorf("a heard its own notes: %q", m)
	}
}

// TestLastingNotesAreRecalled: a lasting note is kept until it expires,
// in the database's clock, and handed to instances that subscribe later;
// a shorter note on the same key does not replace a longer one; expired
// notes are gone.
func TestLastingNotesAreRecalled(t *testing.T) {
	f := newFleet(t, 2, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {})
	a, b := f.insts[0].bus, f.insts[1].bus
	recall := func() map[string]time.Duration {
		var mu sync.Mutex
		m := map[string]time.Duration{}
		b.Subscribe("session", func(msg string, left time.Duration) {
			if left > 0 {
				mu.Lock()
				m[msg] = left
				mu.Unlock()
			}
		})
		mu.Lock()
		defer mu.Unlock()
		out := make(map[string]time.Duration, len(m))
		for k, v := range m {
			out[k] = v
		}
		return out
	}
	a.Publish("session", "s1", "long", time.Minute)
	waitFor(t, "the note to be kept", func() bool { return len(recall()) == 1 })
	a.Publish("session", "s1", "short", 200*time.Millisecond)
	a.Publish("session", "s2", "brief", 200*time.Millisecond)
	waitFor(t, "the second key", func() bool { _, ok := recall()["brief"]; return ok })
	kept := recall()
	if left, ok := kept["long"]; !ok || left < 50*time.Second || left > time.Minute {
		t.Errorf("long note: %v (all %+v)", left, kept)
	}
	if _, ok := kept["short"]; ok {
		t.Errorf("a shorter note replaced a longer one: %+v", kept)
	}
	waitFor(t, "the brief note to expire", func() bool { _, ok := recall()["brief"]; return !ok })
	if _, ok := recall()["long"]; !ok {
		t.Error("the long note went with the brief one")
	}
}

// TestClaimIsExclusiveAcrossInstances: one instance at a time holds a
// claim; releasing it lets the next in; it lapses by itself.
func TestClaimIsExclusiveAcrossInstances(t *testing.T) {
	f := newFleet(t, 2, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {})
	a, b := f.insts[0].bus, f.insts[1].bus
	ctx := context.Background()
	release, ok := a.Claim(ctx, "rotate:s1", time.Minute)
	if !ok {
		t.Fatal("first claim refused")
	}
	if _, ok := b.Claim(ctx, "rotate:s1", time.Minute); ok {
		t.Fatal("a held claim was granted to another instance")
	}
	if _, ok := b.Claim(ctx, "rotate:s2", time.Minute); !ok {
		t.Fatal("claims on other names interfere")
	}
	release()
	if _, ok := b.Claim(ctx, "rotate:s1", 100*time.Millisecond); !ok {
		t.Fatal("a released claim stayed held")
	}
	if _, ok := a.Claim(ctx, "rotate:s1", time.Minute); ok {
		t.Fatal("a claim was granted twice")
	}
	waitFor(t, "the claim to lapse", func() bool {
		_, ok := a.Claim(ctx, "rotate:s1", time.Minute)
		return ok
	})
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
