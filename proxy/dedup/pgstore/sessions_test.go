package pgstore

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// locksOnSession counts the advisory locks inst's first lock session
// holds on the server, taking its turn to read which session that is.
func locksOnSession(t *testing.T, f *fleetFixture, inst *instance) int {
	t.Helper()
	ls := inst.store.sessions[0]
	<-ls.turn
	pid := uint32(0)
	if ls.conn != nil {
		pid = ls.conn.Conn().PgConn().PID()
	}
	ls.turn <- struct{}{}
	var n int
	if err := f.conn().QueryRow(context.Background(), `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = $1`, pid).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// lead joins key's flight on inst, which must lead it with the lock.
func lead(t *testing.T, inst *instance, key string) *lease {
	t.Helper()
	l, out, err := inst.store.Join(context.Background(), key)
	if err != nil || out != nil || l == nil {
		t.Fatalf("join %s: lease %v, outcome %v, %v", key, l, out, err)
	}
	if l.(*lease).sess == nil {
		t.Fatalf("join %s: led without the lock", key)
	}
	return l.(*lease)
}

// TestEndOutlivesTheBreakerAndTheCaller: a flight's end unlocks its lock
// although the breaker opened on other statements meanwhile and the
// caller's context is already done; the next instance then leads at once.
func TestEndOutlivesTheBreakerAndTheCaller(t *testing.T) {
	f := newFleet(t, 2, Config{MaxConns: 3, FlightConns: 1, BreakerInterval: time.Minute}, dedup.Config{}, nil)
	a, b := f.insts[0], f.insts[1]
	l := lead(t, a, "v1:end-breaker")
	for range 3 {
		_ = a.store.exec(context.Background(), func(context.Context) error { return errors.New("test: the database failing") })
	}
	if a.be.Available() {
		t.Fatal("the breaker did not open")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_ = l.Finish(ctx, dedup.Outcome{Err: "origin refused"}, 0)
	if n := locksOnSession(t, f, a); n != 0 {
		t.Fatalf("%d advisory locks left on the session after the flight's end, want 0", n)
	}
	lead(t, b, "v1:end-breaker").Release()
}

// TestEndWaitsForTheTurn: a flight's end waits for its session's turn,
// however long another statement holds it, instead of giving up and
// leaving the lock behind; past its bound the caller goes, and the end
// waits on in the background.
func TestEndWaitsForTheTurn(t *testing.T) {
	f := newFleet(t, 1, Config{MaxConns: 3, FlightConns: 1, Timeout: 100 * time.Millisecond, DialTimeout: 100 * time.Millisecond}, dedup.Config{}, nil)
	a := f.insts[0]
	l := lead(t, a, "v1:end-turn")
	ls := a.store.sessions[0]
	<-ls.turn // another statement, longer than every statement bound
	done := make(chan struct{})
	go func() { l.Release(); close(done) }()
	select {
	case <-done:
	case <-time.After(a.store.finishBound() + 5*time.Second):
		t.Fatal("the release blocked past its bound")
	}
	db := f.conn()
	if n := lockHolders(t, db, l.lock); n != 1 {
		t.Fatalf("%d sessions hold the lock while its end waits, want 1: the end gave up", n)
	}
	ls.turn <- struct{}{}
	waitFor(t, "the end in the background", func() bool { return lockHolders(t, db, l.lock) == 0 })
	if n := locksOnSession(t, f, a); n != 0 {
		t.Fatalf("%d advisory locks left after the release, want 0", n)
	}
	// The key leads again, and its end leaves nothing either (a lock
	// taken twice on one session would need two unlocks).
	l2 := lead(t, a, "v1:end-turn")
	if err := l2.Finish(context.Background(), dedup.Outcome{Err: "x"}, 0); err != nil {
		t.Fatal(err)
	}
	if n := locksOnSession(t, f, a); n != 0 {
		t.Fatalf("%d advisory locks left after the second flight, want 0", n)
	}
}

// entry is a cached 200 with body.
func entry(body string) *dedup.Entry {
	now := time.Now()
	return &dedup.Entry{Status: 200, Header: http.Header{}, Body: []byte(body), StoredAt: now, ExpiresAt: now.Add(time.Minute), URLKey: "u1:" + body}
}

// TestBusySessionsStillShare: steps that find no turn on a busy lock
// session in time look on a pooled connection instead. A cached value is
// still a hit and a key another instance leads is still waited on; a key
// nobody leads is led without the lock, its value still stored for the
// fleet, rather than sent past it. The breaker hears of none of it, so
// the fleet's sharing stays on.
func TestBusySessionsStillShare(t *testing.T) {
	f := newFleet(t, 2, Config{MaxConns: 3, FlightConns: 1, Timeout: 100 * time.Millisecond, DialTimeout: 100 * time.Millisecond, BreakerFailures: 1}, dedup.Config{}, nil)
	a, b := f.insts[0], f.insts[1]
	ctx := context.Background()
	cached := lead(t, b, "v1:busy-cached")
	if err := cached.Finish(ctx, dedup.Outcome{Entry: entry("shared")}, time.Minute); err != nil {
		t.Fatal(err)
	}
	held := lead(t, b, "v1:busy-held")

	ls := a.store.sessions[0]
	<-ls.turn
	l, out, err := a.store.Join(ctx, "v1:busy-free")
	if err != nil || out != nil || l == nil {
		t.Fatalf("join of a key nobody leads on a busy session: lease %v, outcome %+v, %v; want a lease", l, out, err)
	}
	if l.(*lease).sess != nil {
		t.Fatal("led with a lock on a session that had no turn")
	}
	if err := l.Finish(ctx, dedup.Outcome{Entry: entry("led busy")}, time.Minute); err != nil {
		t.Fatalf("finish of the lock-less flight: %v", err)
	}
	if n := a.be.UnlockedFlights(); n != 1 {
		t.Errorf("%d flights counted without the lock, want 1", n)
	}
	if _, out, err := a.store.Join(ctx, "v1:busy-cached"); err != nil || out == nil || out.Entry == nil || string(out.Entry.Body) != "shared" || !out.Cached {
		t.Fatalf("join of a cached key on a busy session: outcome %+v, %v; want the cached value", out, err)
	}
	waited := make(chan *dedup.Outcome, 1)
	go func() {
		_, out, err := a.store.Join(ctx, "v1:busy-held")
		if err != nil {
			t.Errorf("join of a key B leads, on a busy session: %v", err)
		}
		waited <- out
	}()
	waitFor(t, "A waiting on B's flight", func() bool { return a.store.fleetWaits.Load() == 1 })
	if err := held.Finish(ctx, dedup.Outcome{Entry: entry("held")}, time.Minute); err != nil {
		t.Fatal(err)
	}
	if out := <-waited; out == nil || out.Entry == nil || string(out.Entry.Body) != "held" || out.Cached {
		t.Fatalf("the wait on B's flight ended with %+v, want its value", out)
	}
	ls.turn <- struct{}{}

	if _, out, err := b.store.Join(ctx, "v1:busy-free"); err != nil || out == nil || out.Entry == nil || string(out.Entry.Body) != "led busy" {
		t.Fatalf("B on the key A led without the lock: outcome %+v, %v; want its value", out, err)
	}
	if !a.be.Available() || a.be.Errors() != 0 {
		t.Fatalf("after busy sessions: available %v, %d errors; want the breaker closed and nothing counted", a.be.Available(), a.be.Errors())
	}
	if !strings.Contains(f.logs.String(), "raise postgres.flight_conns") {
		t.Error("no warning about the busy lock sessions")
	}
}

// TestCloseEndsLateFlights: a flight that ends after Close gave up waiting
// for it does not reconnect its session behind Close, which would keep
// Close waiting for that connection for good.
func TestCloseEndsLateFlights(t *testing.T) {
	f := newFleet(t, 1, Config{MaxConns: 4, FlightConns: 2}, dedup.Config{}, nil)
	a := f.insts[0]
	var l *lease
	for i := 0; l == nil || l.sess != a.store.sessions[0]; i++ {
		if l != nil {
			l.Release()
		}
		l = lead(t, a, fmt.Sprintf("v1:late-%d", i))
	}
	other := a.store.sessions[1]
	<-other.turn // a statement running on the other session during Close
	closed := make(chan struct{})
	go func() { a.be.Close(); close(closed) }()
	time.Sleep(closeWait + 200*time.Millisecond) // Close gave up on the flight
	// Its lock went with the session Close ended: it ends without it.
	_ = l.Finish(context.Background(), dedup.Outcome{Err: "late"}, 0)
	other.turn <- struct{}{}
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close never returned")
	}
}
