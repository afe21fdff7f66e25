package pgstore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/pgtest"
	"github.com/seed-a3c387e8/onceproxy/internal/workers"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/storecodec"
)

// joined is what a Join in a goroutine came back with.
type joined struct {
	lease dedup.Lease
	out   *dedup.Outcome
	err   error
}

// joinAsync joins key on st in a goroutine; the channel gets its result.
func joinAsync(st *Cache, key string) <-chan joined {
	res := make(chan joined, 1)
	go func() {
		l, out, err := st.Join(context.Background(), key)
		res <- joined{l, out, err}
	}()
	return res
}

// stillWaiting fails the test if the join answered within d: the flight it
// waits on is still led elsewhere.
func stillWaiting(t *testing.T, res <-chan joined, d time.Duration, why string) {
	t.Helper()
	select {
	case r := <-res:
		t.Fatalf("%s: the waiter returned while the next flight still leads: out %s, err %v", why, clip(fmt.Sprintf("%+v", r.out), 200), r.err)
	case <-time.After(d):
	}
}

// answer waits for the join's result.
func answer(t *testing.T, res <-chan joined) joined {
	t.Helper()
	select {
	case r := <-res:
		return r
	case <-time.After(30 * time.Second):
		t.Fatal("the waiter never returned")
	}
	return joined{}
}

// lockHolders counts the sessions that hold the advisory lock lock, asking
// on c.
func lockHolders(t *testing.T, c *pgx.Conn, lock int64) int {
	t.Helper()
	var n int
	// A bigint lock is the pair (classid, objid) of its halves, objsubid 1.
	if err := c.QueryRow(context.Background(), `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted
		AND classid = (($1::bigint >> 32) & 4294967295)::oid AND objid = ($1::bigint & 4294967295)::oid AND objsubid = 1`,
		lock).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// withTurn runs f holding ls's turn, as a statement of the instance would.
func withTurn(ls *lockSession, f func()) {
	<-ls.turn
	defer func() { ls.turn <- struct{}{} }()
	f()
}

// resetSessionLocks gives up every advisory lock ls's connection holds,
// as a session reset would, keeping the connection (and its generation).
func resetSessionLocks(t *testing.T, ls *lockSession) {
	t.Helper()
	withTurn(ls, func() {
		if _, err := ls.conn.Exec(context.Background(), "SELECT pg_advisory_unlock_all()"); err != nil {
			t.Fatal(err)
		}
	})
}

// terminateSession ends ls's connection from the server's side, as a
// server restart or an administrator would. The instance finds out at the
// session's next statement, whose idle ping (made due here) fails.
func terminateSession(t *testing.T, f *fleetFixture, ls *lockSession) {
	t.Helper()
	withTurn(ls, func() {
		var ok bool
		pid := int32(ls.conn.Conn().PgConn().PID())
		if err := f.conn().QueryRow(context.Background(), "SELECT pg_terminate_backend($1)", pid).Scan(&ok); err != nil || !ok {
			t.Fatalf("terminate: %v %v", ok, err)
		}
		ls.used = time.Time{}
	})
}

// leadAfter makes st lead key once the lock is free.
func leadAfter(t *testing.T, st *Cache, key string) dedup.Lease {
	t.Helper()
	var l dedup.Lease
	waitFor(t, "the next leader", func() bool {
		var err error
		var out *dedup.Outcome
		l, out, err = st.Join(context.Background(), key)
		if l == nil && (out != nil || err != nil) {
			t.Fatalf("join: out %+v, err %v", out, err)
		}
		return l != nil
	})
	return l
}

// TestStaleLeaderDoesNotAnswerTheNextFlight: a leader whose lock went
// (its connection dropped, its session reset, or it never had one) ends
// with a failure while another instance leads the key's next flight: the
// failure, the waiters' mark and the wake-up are not its to write, and the
// next flight's waiters get the next flight's answer. With nobody leading,
// a lockless flight's outcome is still shared.
func TestStaleLeaderDoesNotAnswerTheNextFlight(t *testing.T) {
	for _, tc := range []struct {
		name string
		// lose gives A a lease on key whose lock is gone, or that never
		// had one.
		lose func(t *testing.T, f *fleetFixture, a *Cache, key string) dedup.Lease
	}{
		{"connection dropped", func(t *testing.T, f *fleetFixture, a *Cache, key string) dedup.Lease {
			l := lead(t, &instance{store: a}, key)
			terminateSession(t, f, l.sess)
			return l
		}},
		{"session reset", func(t *testing.T, f *fleetFixture, a *Cache, key string) dedup.Lease {
			l := lead(t, &instance{store: a}, key)
			resetSessionLocks(t, l.sess)
			return l
		}},
		{"led without the lock", func(t *testing.T, f *fleetFixture, a *Cache, key string) dedup.Lease {
			return a.unlockedLease(key, flightLocksTaken)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFleet(t, 3, Config{}, dedup.Config{}, nil)
			a, b, c := f.insts[0].store, f.insts[1].store, f.insts[2].store
			ctx := context.Background()
			db := f.conn()
			key := "v1:stale-" + strings.ReplaceAll(tc.name, " ", "-")
			la := tc.lose(t, f, a, key)
			lb := leadAfter(t, b, key)
			res := joinAsync(c, key)
			waitFor(t, "C waiting on B's flight", func() bool { return c.fleetWaits.Load() == 1 })

			_ = la.Finish(ctx, dedup.Outcome{Err: "the stale leader's failure"}, 0)
			stillWaiting(t, res, time.Second, "after the stale leader's end")
			var marks int
			if err := db.QueryRow(ctx, schemaSQL(f.schema, `SELECT count(*) FROM {s}.outcomes WHERE key = $1`), waitRowKey(key)).Scan(&marks); err != nil || marks != 1 {
				t.Fatalf("C's mark on B's flight: %d rows (%v), want 1", marks, err)
			}

			if err := lb.Finish(ctx, dedup.Outcome{Err: "the next flight's answer"}, 0); err != nil {
				t.Fatal(err)
			}
			if r := answer(t, res); r.err != nil || r.out == nil || r.out.Err != "the next flight's answer" {
				t.Fatalf("C: out %+v, err %v; want the next flight's answer", r.out, r.err)
			}

			// Nobody leads: a flight without the lock still shares its
			// outcome.
			other := key + "-alone"
			if err := a.unlockedLease(other, flightLocksTaken).Finish(ctx, dedup.Outcome{Err: "alone"}, 0); err != nil {
				t.Fatal(err)
			}
			var n int
			if err := db.QueryRow(ctx, schemaSQL(f.schema, `SELECT count(*) FROM {s}.outcomes WHERE key = $1`), other).Scan(&n); err != nil || n != 1 {
				t.Fatalf("the outcome of a flight nobody else leads: %d rows (%v), want 1", n, err)
			}
		})
	}
}

// TestStaleLeaderDoesNotStream: a leader whose lock went does not send the
// waiters of the key's next flight, led elsewhere, to its peer listener.
func TestStaleLeaderDoesNotStream(t *testing.T) {
	for _, tc := range []struct {
		name string
		lose func(t *testing.T, a *Cache, l *lease)
	}{
		{"connection dropped", func(t *testing.T, a *Cache, l *lease) {
			withTurn(l.sess, func() { a.dropSession(l.sess) })
		}},
		{"session reset", func(t *testing.T, a *Cache, l *lease) { resetSessionLocks(t, l.sess) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFleet(t, 3, Config{}, dedup.Config{}, nil)
			a, b, c := f.insts[0].store, f.insts[1].store, f.insts[2].store
			ctx := context.Background()
			db := f.conn()
			key := "v1:stale-stream-" + strings.ReplaceAll(tc.name, " ", "-")
			a.AdvertisePeer("127.0.0.1:7070")
			la := lead(t, &instance{store: a}, key)
			defer la.Release()
			tc.lose(t, a, la)
			lb := leadAfter(t, b, key)
			res := joinAsync(c, key)
			waitFor(t, "C waiting on B's flight", func() bool { return c.fleetWaits.Load() == 1 })

			if err := la.Stream(ctx); err == nil {
				t.Error("a leader without its lock streamed")
			}
			stillWaiting(t, res, time.Second, "after the stale leader's Stream")
			var n int
			if err := db.QueryRow(ctx, schemaSQL(f.schema, `SELECT count(*) FROM {s}.outcomes WHERE key = $1 OR key = $2`), key, peerRowKey(key)).Scan(&n); err != nil || n != 0 {
				t.Fatalf("%d outcome or peer rows for B's flight (%v), want none", n, err)
			}
			if err := lb.Finish(ctx, dedup.Outcome{Err: "the next flight's answer"}, 0); err != nil {
				t.Fatal(err)
			}
			if r := answer(t, res); r.err != nil || r.out == nil || r.out.Err != "the next flight's answer" {
				t.Fatalf("C: out %+v, err %v; want the next flight's answer", r.out, r.err)
			}
		})
	}
}

// randomText is n characters of random hex, which compress to no less
// than half their size.
func randomText(n int) string {
	b := make([]byte, n/2)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// TestOversizedRowsAreDropped: a value or an outcome bigger than
// max_value_bytes (this build never writes one; psql or an instance with a
// larger limit did) is not read: it is dropped, counted, and the key is a
// miss. Even a huge one costs a reader no more than any other row, so the
// breaker never hears of it.
func TestOversizedRowsAreDropped(t *testing.T) {
	const limit = 4 * bytesize.KiB
	ctx := context.Background()
	bigEntry := func() []byte {
		return storecodec.Encode(&dedup.Entry{Status: 200, Body: []byte(randomText(4 * int(limit))),
			StoredAt: time.Now(), ExpiresAt: time.Now().Add(time.Hour)})
	}
	rows := func(t *testing.T, f *fleetFixture, db *pgx.Conn, table, key string) int {
		t.Helper()
		var n int
		if err := db.QueryRow(ctx, schemaSQL(f.schema, `SELECT count(*) FROM {s}.`+table+` WHERE key = $1`), key).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	t.Run("value joined", func(t *testing.T) {
		f := newFleet(t, 1, Config{MaxValueBytes: limit}, dedup.Config{}, nil)
		inst := f.insts[0]
		db := f.conn()
		key := "v1:oversized-join"
		f.exec(`INSERT INTO {s}.cache VALUES ($1, '', $2, 1, now(), now() + interval '1 hour')`, key, bigEntry())
		joinMiss(t, inst, key)
		waitFor(t, "the oversized value to be dropped", func() bool { return rows(t, f, db, "cache", key) == 0 })
		if inst.be.Rejected() < 1 || inst.be.Errors() != 0 {
			t.Fatalf("%d rejected, %d errors; want at least 1, and 0", inst.be.Rejected(), inst.be.Errors())
		}
		lead(t, inst, key).Release()
	})

	t.Run("value read", func(t *testing.T) {
		f := newFleet(t, 1, Config{MaxValueBytes: limit}, dedup.Config{}, nil)
		inst := f.insts[0]
		db := f.conn()
		key := "v1:oversized-get"
		f.exec(`INSERT INTO {s}.cache VALUES ($1, '', $2, 1, now(), now() + interval '1 hour')`, key, bigEntry())
		if e, err := inst.store.Get(ctx, key); err == nil {
			t.Fatalf("read an oversized value: %d bytes of body", len(e.Body))
		}
		waitFor(t, "the oversized value to be dropped", func() bool { return rows(t, f, db, "cache", key) == 0 })
		if inst.be.Rejected() != 1 {
			t.Fatalf("%d rejected, want 1", inst.be.Rejected())
		}
	})

	t.Run("outcome", func(t *testing.T) {
		f := newFleet(t, 1, Config{MaxValueBytes: limit, PollInterval: 20 * time.Millisecond}, dedup.Config{}, nil)
		inst := f.insts[0]
		db := f.conn()
		key := "v1:oversized-outcome"
		// A leader elsewhere: a session of the test's own holds the lock.
		leader := f.conn()
		var ok bool
		if err := leader.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", inst.store.lockID(key)).Scan(&ok); err != nil || !ok {
			t.Fatalf("lock: %v %v", ok, err)
		}
		res := joinAsync(inst.store, key)
		waitFor(t, "the join to wait", func() bool { return inst.store.fleetWaits.Load() == 1 })
		f.exec(`INSERT INTO {s}.outcomes VALUES ($1, $2, now() + interval '1 minute')`, key,
			storecodec.EncodeOutcome(dedup.Outcome{Err: randomText(4 * int(limit))}))
		stillWaiting(t, res, 500*time.Millisecond, "after the oversized outcome")
		waitFor(t, "the oversized outcome to be dropped", func() bool {
			return inst.be.Rejected() >= 1 && rows(t, f, db, "outcomes", key) == 0
		})
		f.exec(`INSERT INTO {s}.outcomes VALUES ($1, $2, now() + interval '1 minute')`, key,
			storecodec.EncodeOutcome(dedup.Outcome{Err: "origin refused"}))
		if r := answer(t, res); r.err != nil || r.out == nil || r.out.Err != "origin refused" {
			t.Fatalf("join: out %+v, err %v", r.out, r.err)
		}
	})

	t.Run("huge", func(t *testing.T) {
		// 64 MB take a reader about a second on loopback: four statement
		// timeouts, every one counted by the breaker, were it read.
		f := newFleet(t, 1, Config{Timeout: 250 * time.Millisecond, BreakerFailures: 2, BreakerInterval: time.Minute}, dedup.Config{}, nil)
		inst := f.insts[0]
		db := f.conn()
		key := "v1:oversized-huge"
		f.exec(`INSERT INTO {s}.cache VALUES ($1, '', convert_to(repeat('x', 64000000), 'SQL_ASCII'), 1, now(), now() + interval '1 hour')`, key)
		for range 3 {
			if _, err := inst.store.Get(ctx, key); err == nil {
				t.Fatal("read a huge garbage value")
			}
		}
		if inst.be.Errors() != 0 {
			t.Fatalf("reads: %d errors, want none", inst.be.Errors())
		}
		waitFor(t, "the huge value to be dropped", func() bool { return rows(t, f, db, "cache", key) == 0 })
		f.exec(`INSERT INTO {s}.cache VALUES ($1, '', convert_to(repeat('x', 64000000), 'SQL_ASCII'), 1, now(), now() + interval '1 hour')`, key)
		for range 3 {
			joinMiss(t, inst, key)
		}
		waitFor(t, "the huge value to be dropped", func() bool { return rows(t, f, db, "cache", key) == 0 })
		if inst.be.Errors() != 0 || !inst.be.Available() {
			t.Fatalf("joins: %d errors, available %v; want none, and the shared layer on", inst.be.Errors(), inst.be.Available())
		}
		lead(t, inst, key).Release()
	})
}

// joinMiss joins key on inst, a key whose row is too big to read: it is a
// miss, led here, or, while the row is still being dropped, to be fetched
// without the fleet; never a hit, an outcome or a database failure.
func joinMiss(t *testing.T, inst *instance, key string) {
	t.Helper()
	l, out, err := inst.store.Join(context.Background(), key)
	if l != nil {
		l.Release()
	}
	if out != nil || (l == nil && !errors.Is(err, errUnreadable)) {
		t.Fatalf("join: lease %v, out %+v, err %v; want a miss", l != nil, out, err)
	}
}

// within polls cond every 10ms for up to d.
func within(d time.Duration, cond func() bool) bool {
	for end := time.Now().Add(d); ; time.Sleep(10 * time.Millisecond) {
		if cond() {
			return true
		}
		if time.Now().After(end) {
			return false
		}
	}
}

// TestAbsurdExpiriesAreIgnoredAndSwept: notes and claims that last past
// maxLasting ('infinity' among them, which only a person with psql
// writes), and rows of any table that never expire, are ignored when
// recalled, give way to the next write of their key, and are swept; what
// this package writes stays.
func TestAbsurdExpiriesAreIgnoredAndSwept(t *testing.T) {
	f := newFleet(t, 1, Config{SweepInterval: time.Hour}, dedup.Config{}, nil)
	inst := f.insts[0]
	ctx := context.Background()
	c := f.conn()
	count := func(sql string, args ...any) int {
		t.Helper()
		var n int
		if err := c.QueryRow(ctx, schemaSQL(f.schema, sql), args...).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	f.exec(`INSERT INTO {s}.notes VALUES ('session', 'forever', 'forever', 'infinity'),
			('session', 'far', 'far', now() + interval '100 years'),
			('session', 'good', 'good', now() + interval '1 hour'),
			('session', 'replaced', 'forever', 'infinity');
		INSERT INTO {s}.claims VALUES ('stuck', 'someone', 'infinity'), ('forever', 'someone', 'infinity'),
			('far', 'someone', now() + interval '100 years'), ('held', 'someone', now() + interval '1 hour');
		INSERT INTO {s}.cache VALUES ('v1:forever', '', '\x00', 1, now(), 'infinity');
		INSERT INTO {s}.outcomes VALUES ('v1:forever', '\x00', 'infinity');
		INSERT INTO {s}.counters VALUES ('forever', 1, 'infinity');
		INSERT INTO {s}.bindings VALUES ('forever', 's1', 'infinity')`)

	var mu sync.Mutex
	var heard []string
	errs := inst.be.Errors()
	inst.bus.Subscribe("session", func(msg string, left time.Duration) {
		mu.Lock()
		heard = append(heard, msg)
		mu.Unlock()
	})
	mu.Lock()
	if strings.Join(heard, ",") != "good" {
		t.Errorf("recalled %q, want only the good note", heard)
	}
	mu.Unlock()
	if inst.be.Errors() != errs || inst.be.Rejected() != 3 {
		t.Errorf("recall: %d statement errors, %d rejected; want 0 and 3", inst.be.Errors()-errs, inst.be.Rejected())
	}

	inst.bus.Publish("session", "replaced", "new", time.Minute)
	if !within(10*time.Second, func() bool {
		return count(`SELECT count(*) FROM {s}.notes WHERE key = 'replaced' AND msg = 'new' AND expires_at < now() + interval '1 hour'`) == 1
	}) {
		t.Error("a lasting note did not replace one lasting for ever")
	}
	if _, ok := inst.bus.Claim(ctx, "stuck", time.Minute); !ok {
		t.Error("a claim lasting for ever held its name")
	}
	if _, ok := inst.bus.Claim(ctx, "held", time.Minute); ok {
		t.Error("a claim held for an hour gave way")
	}

	inst.be.sweep.once(ctx)
	if n := count(`SELECT count(*) FROM {s}.notes`); n != 2 {
		t.Errorf("%d notes after the sweep, want 2: the good one and the replaced one", n)
	}
	if n := count(`SELECT count(*) FROM {s}.claims`); n != 2 {
		t.Errorf("%d claims after the sweep, want 2: the held one and ours", n)
	}
	for _, table := range []string{"cache", "outcomes", "counters", "bindings"} {
		if n := count(`SELECT count(*) FROM {s}.` + table + ` WHERE expires_at = 'infinity'`); n != 0 {
			t.Errorf("%d rows of %s that never expire left after the sweep", n, table)
		}
	}
}

// blackhole forwards loopback connections to the database until cut, then
// drops every byte both ways: a database gone silent.
type blackhole struct {
	ln     net.Listener
	cut    atomic.Bool
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  []net.Conn
	closed bool
}

func startBlackhole(t *testing.T, target string) *blackhole {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &blackhole{ln: ln}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.wg.Add(1)
			go func() { defer p.wg.Done(); p.serve(c, target) }()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		p.closeAll()
		p.wg.Wait()
	})
	return p
}

// closeAll closes every connection through p, and every one made from
// now on: whoever uses one learns at once that it is gone.
func (p *blackhole) closeAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	for _, c := range p.conns {
		c.Close()
	}
}

func (p *blackhole) track(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		c.Close()
	}
	p.conns = append(p.conns, c)
}

func (p *blackhole) serve(c net.Conn, target string) {
	p.track(c)
	defer c.Close()
	s, err := net.Dial("tcp", target)
	if err != nil {
		return
	}
	p.track(s)
	defer s.Close()
	pipe := func(dst, src net.Conn) {
		buf := make([]byte, 32<<10)
		for {
			n, err := src.Read(buf)
			if n > 0 && !p.cut.Load() {
				dst.Write(buf[:n])
			}
			if err != nil {
				return
			}
		}
	}
	// Either side gone, the other goes too: a peer waiting on what the
	// cut dropped would otherwise wait for the server's timeouts.
	done := make(chan struct{})
	go func() { defer close(done); pipe(s, c); s.Close() }()
	pipe(c, s)
	c.Close()
	<-done
}

// TestEndsDoNotQueueBehindADeadSession: flights on a lock session whose
// database went silent end within Finish's bound each, however many: the
// first end's batch times out and drops the connection, and the ends
// queued behind it find their locks gone instead of each connecting again
// in turn.
func TestEndsDoNotQueueBehindADeadSession(t *testing.T) {
	direct, schema := pgtest.Schema(t)
	target := direct[strings.Index(direct, "@")+1:]
	target = target[:strings.Index(target, "/")]
	p := startBlackhole(t, target)
	url := strings.Replace(direct, target, p.ln.Addr().String(), 1)
	const dial, timeout = 500 * time.Millisecond, 250 * time.Millisecond
	f := startFleet(t, &fleetFixture{t: t, url: url, schema: schema}, 1,
		Config{MaxConns: 4, FlightConns: 1, Timeout: timeout, DialTimeout: dial, BreakerInterval: 5 * time.Second},
		dedup.Config{}, nil)
	// Before the instance stops: it closes connections that are silent
	// otherwise.
	t.Cleanup(p.closeAll)
	a := f.insts[0].store
	const n = 24
	var leases []dedup.Lease
	for i := range n {
		leases = append(leases, lead(t, &instance{store: a}, fmt.Sprintf("v1:dead-session-%d", i)))
	}
	p.cut.Store(true)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var worst time.Duration
	cut := time.Now()
	for _, l := range leases {
		wg.Go(func() {
			start := time.Now()
			_ = l.Finish(context.Background(), dedup.Outcome{Err: "origin refused"}, 0)
			d := time.Since(start)
			mu.Lock()
			worst = max(worst, d)
			mu.Unlock()
		})
		time.Sleep(5 * time.Millisecond) // queued in turn
	}
	wg.Wait()
	// Finish's bound: the turn, the end's batch, the end without the
	// lock (finishBound); a second for a loaded machine.
	bound := 3*dial + 7*timeout
	if worst > bound+time.Second {
		t.Fatalf("the slowest of %d ends behind a dead session took %s, past Finish's bound of %s", n, worst.Round(time.Millisecond), bound)
	}
	// Ends handed over to the background (past their wait for the turn)
	// do not queue either: a connection attempt each, in turn, would
	// take n dial timeouts.
	ctx, cancel := context.WithDeadline(context.Background(), cut.Add(bound+time.Second))
	defer cancel()
	if err := workers.Wait(ctx, &a.leases); err != nil {
		t.Fatalf("the ends behind a dead session were not all over %s after it went silent", time.Since(cut).Round(time.Millisecond))
	}
	t.Logf("the slowest of %d Finishes took %s, every end was over after %s (bound %s)",
		n, worst.Round(time.Millisecond), time.Since(cut).Round(time.Millisecond), bound)
}

// TestEndHandedOverPastItsTurn: an end whose session another statement
// holds past the end's wait returns within Finish's bound, and still
// gives the lock up, in the background, once the turn comes: the waiters
// then get the flight's answer.
func TestEndHandedOverPastItsTurn(t *testing.T) {
	const dial, timeout = 100 * time.Millisecond, 100 * time.Millisecond
	f := newFleet(t, 2, Config{MaxConns: 3, FlightConns: 1, Timeout: timeout, DialTimeout: dial}, dedup.Config{}, nil)
	a, b := f.insts[0], f.insts[1]
	key := "v1:end-handed-over"
	l := lead(t, a, key)
	res := joinAsync(b.store, key)
	waitFor(t, "B waiting on A's flight", func() bool { return b.store.fleetWaits.Load() == 1 })
	ls := a.store.sessions[0]
	<-ls.turn // another statement, longer than every bound
	done := make(chan error, 1)
	go func() { done <- l.Finish(context.Background(), dedup.Outcome{Err: "origin refused"}, 0) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("finish: %v", err)
		}
	case <-time.After(3*dial + 7*timeout + 5*time.Second): // finishBound, and a margin
		t.Fatal("Finish blocked past its bound behind a busy session")
	}
	stillWaiting(t, res, 200*time.Millisecond, "before the end ran")
	ls.turn <- struct{}{}
	if r := answer(t, res); r.err != nil || r.out == nil || r.out.Err != "origin refused" {
		t.Fatalf("B: out %+v, err %v", r.out, r.err)
	}
	db := f.conn()
	waitFor(t, "the lock given up", func() bool { return lockHolders(t, db, l.lock) == 0 })
	if got := f.logs.String(); !strings.Contains(got, "goes on in the background") {
		t.Error("the handed-over end was not logged")
	}
}
