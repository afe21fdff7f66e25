package pgstore

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

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/pgtest"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestSweepExpiresAndBoundsTheTable: a sweep deletes expired rows of every
// table and old statistics, and keeps the cache table within max_bytes,
// oldest rows first; while another instance sweeps, it does nothing.
func TestSweepExpiresAndBoundsTheTable(t *testing.T) {
	const maxBytes = 4 * bytesize.KiB
	f := newFleet(t, 1, Config{MaxBytes: maxBytes, MaxValueBytes: bytesize.KiB, SweepInterval: time.Hour}, dedup.Config{},
		func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, strings.Repeat("x", 100)) })
	inst := f.insts[0]
	ctx := context.Background()
	var keys []string
	for i := range 40 {
		keys = append(keys, inst.get(fmt.Sprintf("%s/page/%02d", f.origin.URL, i)).key)
		time.Sleep(2 * time.Millisecond) // distinct stored_at
	}
	f.exec(`INSERT INTO {s}.cache VALUES ('v1:expired', '', '\x00', 1, now(), now() - interval '1 second');
		INSERT INTO {s}.outcomes VALUES ('v1:expired', '\x00', now() - interval '1 second');
		INSERT INTO {s}.notes VALUES ('session', 'old', 'x', now() - interval '1 second');
		INSERT INTO {s}.claims VALUES ('old', 't', now() - interval '1 second');
		INSERT INTO {s}.counters VALUES ('old', 1, now() - interval '1 second');
		INSERT INTO {s}.stats (day, hit) VALUES (current_date - 30, 1), (current_date - 2, 1)`)
	var total int64
	c := f.conn()
	if err := c.QueryRow(ctx, schemaSQL(f.schema, `SELECT sum(size) FROM {s}.cache`)).Scan(&total); err != nil || total <= int64(maxBytes) {
		t.Fatalf("set-up: the table holds %d bytes (%v), want more than %d", total, err, maxBytes)
	}

	// Another instance is sweeping: this one leaves it alone.
	tx, err := c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", inst.store.lockID("sweep")); err != nil {
		t.Fatal(err)
	}
	inst.be.sweep.once(ctx)
	if n := inst.be.sweep.expired.Load() + inst.be.sweep.evicted.Load(); n != 0 {
		t.Fatalf("swept %d rows while another instance held the sweep", n)
	}
	tx.Rollback(ctx)

	inst.be.sweep.once(ctx)
	if n := inst.be.sweep.expired.Load(); n != 5 {
		t.Errorf("expired %d rows, want 5 (one per table)", n)
	}
	var rows int
	if err := c.QueryRow(ctx, schemaSQL(f.schema, `SELECT
		(SELECT count(*) FROM {s}.outcomes) + (SELECT count(*) FROM {s}.notes) + (SELECT count(*) FROM {s}.claims) +
		(SELECT count(*) FROM {s}.counters) + (SELECT count(*) FROM {s}.cache WHERE key = 'v1:expired') +
		(SELECT count(*) FROM {s}.stats WHERE day < current_date - 8)`)).Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("%d expired rows left (%v)", rows, err)
	}
	if err := c.QueryRow(ctx, schemaSQL(f.schema, `SELECT coalesce(sum(size), 0) FROM {s}.cache`)).Scan(&total); err != nil || total > int64(maxBytes) || total < int64(maxBytes)/2 {
		t.Fatalf("after the sweep the table holds %d bytes (%v), want at most %d and not much less", total, err, maxBytes)
	}
	var recent int
	if err := c.QueryRow(ctx, schemaSQL(f.schema, `SELECT count(*) FROM {s}.stats WHERE day = current_date - 2`)).Scan(&recent); err != nil || recent != 1 {
		t.Errorf("the statistics of two days ago are gone (%d, %v)", recent, err)
	}
	// Oldest first: what is left is the newest pages, without a gap.
	present := make([]bool, len(keys))
	for i, k := range keys {
		var n int
		_ = c.QueryRow(ctx, schemaSQL(f.schema, `SELECT count(*) FROM {s}.cache WHERE key = $1`), k).Scan(&n)
		present[i] = n == 1
	}
	first := len(keys)
	for i, p := range present {
		if p {
			first = i
			break
		}
	}
	for i := first; i < len(keys); i++ {
		if !present[i] {
			t.Fatalf("page %d evicted while an older one (%d) stayed: %v", i, first, present)
		}
	}
	if first == 0 || first == len(keys) {
		t.Fatalf("evicted none or all: %v", present)
	}
	if inst.be.sweep.evicted.Load() != int64(first) {
		t.Errorf("evicted counter %d, want %d", inst.be.sweep.evicted.Load(), first)
	}
}

// TestFlightsBeyondFlightLocks: with flight_locks flights of this
// instance leading already, a new flight runs without the lock: it is
// still answered, still stored for the fleet, and counted.
func TestFlightsBeyondFlightLocks(t *testing.T) {
	release := make(chan struct{})
	arrived := make(chan struct{}, 1)
	f := newFleet(t, 2, Config{MaxConns: 3, FlightConns: 1, FlightLocks: 1}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			arrived <- struct{}{}
			<-release
		}
		io.WriteString(w, "page "+r.URL.Path)
	})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unblock) // before the origin closes, which waits for its handlers
	a, b := f.insts[0], f.insts[1]
	slow := make(chan got, 1)
	go func() { slow <- a.get(f.origin.URL + "/slow") }()
	<-arrived // A leads, with its only lock
	// Another instance asking for the slow page waits on A's lock.
	slowB := make(chan got, 1)
	go func() { slowB <- b.get(f.origin.URL + "/slow") }()
	waitFor(t, "B waiting on A's flight", func() bool { return b.store.fleetWaits.Load() == 1 })

	if g := a.get(f.origin.URL + "/other"); g.status != 200 || g.xcache != dedup.CacheMiss || g.body != "page /other" {
		t.Fatalf("a flight beyond flight_locks: %+v", g)
	}
	if n := a.be.UnlockedFlights(); n != 1 {
		t.Errorf("%d flights counted without the lock, want 1", n)
	}
	if g := b.get(f.origin.URL + "/other"); g.xcache != dedup.CacheHit {
		t.Errorf("B after A's lock-less flight: %+v, want a HIT", g)
	}
	unblock()
	if g := <-slow; g.xcache != dedup.CacheMiss {
		t.Fatalf("A's slow flight: %+v", g)
	}
	if g := <-slowB; g.xcache != dedup.CacheCoalesced {
		t.Fatalf("B on the slow page: %+v", g)
	}
	if !strings.Contains(f.logs.String(), "raise postgres.flight_locks") {
		t.Error("no warning about the exhausted flight locks")
	}
	if f.hits.Load() != 2 {
		t.Errorf("origin saw %d requests, want 2", f.hits.Load())
	}
}

// TestManyFlightsOnOneSession: one flight connection holds the locks of
// every flight its instance leads at once, while their fetches run: each
// is led with its lock, the other instance waits on every one of them
// (one fetch per key fleet-wide), and the session then serves the next
// flights, all of it on a single server session.
func TestManyFlightsOnOneSession(t *testing.T) {
	const n = 6
	release := make(chan struct{})
	arrived := make(chan struct{}, n)
	// A server of its own: the locks counted below are this fleet's only.
	f := newFleetOn(t, pgtest.Start(t), 2, Config{MaxConns: 3, FlightConns: 1}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/slow/") {
			arrived <- struct{}{}
			<-release
		}
		io.WriteString(w, "page "+r.URL.Path)
	})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unblock)
	a, b := f.insts[0], f.insts[1]
	resA, resB := make(chan got, n), make(chan got, n)
	for i := range n {
		go func() { resA <- a.get(fmt.Sprintf("%s/slow/%d", f.origin.URL, i)) }()
	}
	for range n {
		<-arrived // A leads all of them
	}
	for i := range n {
		go func() { resB <- b.get(fmt.Sprintf("%s/slow/%d", f.origin.URL, i)) }()
	}
	waitFor(t, "B waiting on each of A's flights", func() bool { return b.store.fleetWaits.Load() == n })
	c := f.conn()
	var sessions, locks int
	if err := c.QueryRow(context.Background(), `SELECT count(DISTINCT pid), count(*) FROM pg_locks
		WHERE locktype = 'advisory' AND granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`).Scan(&sessions, &locks); err != nil {
		t.Fatal(err)
	}
	if sessions != 1 || locks != n {
		t.Errorf("%d advisory locks held by %d sessions, want %d by 1", locks, sessions, n)
	}
	unblock()
	for range n {
		if g := <-resA; g.status != 200 || g.xcache != dedup.CacheMiss {
			t.Fatalf("A: %+v", g)
		}
		if g := <-resB; g.status != 200 || g.xcache != dedup.CacheCoalesced {
			t.Fatalf("B: %+v", g)
		}
	}
	if g := a.get(f.origin.URL + "/next"); g.xcache != dedup.CacheMiss {
		t.Fatalf("A's next flight: %+v", g)
	}
	if n := a.store.unlocked.Load(); n != 0 {
		t.Errorf("%d flights led without the lock, want none", n)
	}
	if got := f.hits.Load(); got != n+1 {
		t.Errorf("origin saw %d requests, want %d: one per key", got, n+1)
	}
}

// TestFailedEndKeepsTheSession: a flight whose end fails inside its
// transaction (here a trigger refuses its row) gives up its own lock and
// nothing else: another flight's lock on the same session stays held, so
// the instance waiting on it still coalesces instead of fetching again.
func TestFailedEndKeepsTheSession(t *testing.T) {
	release := make(chan struct{})
	arrived := make(chan struct{}, 1)
	big := make([]byte, 64<<10)
	for i := range big {
		big[i] = byte(i*7919 + i>>8) // not compressible to under the trigger's bound
	}
	f := newFleet(t, 2, Config{MaxConns: 3, FlightConns: 1}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/slow":
			arrived <- struct{}{}
			<-release
			io.WriteString(w, "slow page")
		case "/refused":
			w.Write(big)
		}
	})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unblock)
	c := f.conn()
	for _, sql := range []string{
		fmt.Sprintf(`CREATE FUNCTION %s.refuse_big() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF octet_length(NEW.value) > 32768 THEN RAISE EXCEPTION 'test: refused'; END IF;
	RETURN NEW;
END $$`, f.schema),
		fmt.Sprintf(`CREATE TRIGGER refuse_big BEFORE INSERT OR UPDATE ON %s.cache FOR EACH ROW EXECUTE FUNCTION %[1]s.refuse_big()`, f.schema),
	} {
		if _, err := c.Exec(context.Background(), sql); err != nil {
			t.Fatal(err)
		}
	}
	a, b := f.insts[0], f.insts[1]
	slow := make(chan got, 1)
	go func() { slow <- a.get(f.origin.URL + "/slow") }()
	<-arrived // A leads /slow, its lock on A's one session
	slowB := make(chan got, 1)
	go func() { slowB <- b.get(f.origin.URL + "/slow") }()
	waitFor(t, "B waiting on A's flight", func() bool { return b.store.fleetWaits.Load() == 1 })

	if g := a.get(f.origin.URL + "/refused"); g.status != 200 || len(g.body) != len(big) {
		t.Fatalf("the flight whose end fails: %d, %d bytes", g.status, len(g.body))
	}
	if !strings.Contains(f.logs.String(), "test: refused") {
		t.Fatal("the refused row was not reported")
	}
	if held := locksOnSession(t, f, a); held != 1 {
		t.Fatalf("A's session holds %d advisory locks after the failed end, want 1: the slow flight's", held)
	}
	unblock()
	if g := <-slow; g.xcache != dedup.CacheMiss {
		t.Fatalf("A's slow flight: %+v", g)
	}
	if g := <-slowB; g.xcache != dedup.CacheCoalesced || g.body != "slow page" {
		t.Fatalf("B on the slow page: %+v, want COALESCED: its lock should have outlived the other flight's failure", g)
	}
	if g := a.get(f.origin.URL + "/next"); g.status != 200 {
		t.Fatalf("A's next flight: %+v", g)
	}
	if n := a.store.unlocked.Load(); n != 0 {
		t.Errorf("%d flights led without the lock, want none", n)
	}
}

// TestLockTableFullLeadsWithoutTheLock: on a server whose lock table is
// too small for the flights in flight, the flights that find no room lead
// without the lock, counted, and every client gets its answer; the breaker
// stays closed, so the flights that have a lock keep the fleet's.
func TestLockTableFullLeadsWithoutTheLock(t *testing.T) {
	// 10 × 20 lock slots, and PostgreSQL's spare shared memory beyond.
	pg := pgtest.Start(t, "max_locks_per_transaction=10", "max_connections=20")
	const n = 1500
	release := make(chan struct{})
	var arrived atomic.Int64
	// A generous statement timeout: each flight's step waits for a turn
	// on one of two lock sessions, and past the timeout (production's
	// 250ms, the fixture's 2s) a step gives up and its flight goes
	// upstream without the fleet (BYPASS), never reaching the lock
	// table. On two loaded cores most of the 1,500 once did, and the
	// table never filled.
	f := newFleetOn(t, pg, 1, Config{FlightLocks: 2 * n, Timeout: time.Minute}, dedup.Config{MaxFlights: 2 * n, MaxFlightsPerClient: 2 * n}, func(w http.ResponseWriter, r *http.Request) {
		arrived.Add(1)
		<-release
		io.WriteString(w, "page "+r.URL.Path)
	})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unblock)
	a := f.insts[0]
	res := make(chan got, n)
	for i := range n {
		go func() { res <- a.get(fmt.Sprintf("%s/p/%d", f.origin.URL, i)) }()
	}
	waitFor(t, "every flight at the origin", func() bool { return arrived.Load() == n })
	unlocked, available := a.be.UnlockedFlights(), a.be.Available()
	unblock()
	xcache := map[string]int{}
	for range n {
		g := <-res
		if g.status != 200 || !strings.HasPrefix(g.body, "page /p/") {
			t.Fatalf("client: %+v", g)
		}
		xcache[g.xcache]++
	}
	if unlocked == 0 || unlocked == n {
		t.Fatalf("%d of %d flights led without the lock, want some but not all: the lock table should have filled up (X-Cache %v)", unlocked, n, xcache)
	}
	if !available {
		t.Fatal("the breaker opened: a full lock table counted as the database failing")
	}
	if xcache["MISS"] != n {
		t.Errorf("X-Cache %v, want every flight a MISS (a BYPASS never reached the lock table)", xcache)
	}
	if !strings.Contains(f.logs.String(), "lock table is full") {
		t.Error("no warning about the full lock table")
	}
	t.Logf("%d of %d flights led without the lock", unlocked, n)
}
