package pgstore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/logbuf"
	"github.com/seed-a3c387e8/onceproxy/internal/pgtest"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestIdleSessionTimeoutKeepsFlightLock: a server (or role, or database)
// with idle_session_timeout set once ended a lock session that sat idle
// while its leader fetched: the flight's lock went, and a second instance
// led the same key while the first was still fetching. Our connections
// turn the setting off.
func TestIdleSessionTimeoutKeepsFlightLock(t *testing.T) {
	pg := pgtest.Start(t, "idle_session_timeout=1000")
	f := newFleetOn(t, pg, 2, Config{}, dedup.Config{}, nil)
	a, b := f.insts[0], f.insts[1]
	const key = "v1:ops-idle-session"
	l := lead(t, a, key)
	defer l.Release()
	// A fetch that takes a while, with no other flight on the session.
	time.Sleep(2500 * time.Millisecond)
	if n := lockHolders(t, f.conn(), l.lock); n != 1 {
		t.Errorf("the flight's lock is held by %d sessions while its leader still fetches, want 1", n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	l2, out, err := b.store.Join(ctx, key)
	if l2 != nil {
		defer l2.Release()
		t.Fatalf("a second instance leads the key while the first still fetches (two leaders)")
	}
	t.Logf("second instance: out %v, err %v (waiting is right)", out, err)
}

// TestSchemaPrecreatedForTheRole: the usual least-privilege setup, a DBA
// creating the schema for an application role that may not create schemas
// in the database, brings the shared layer up. CREATE SCHEMA IF NOT EXISTS
// checks the database's CREATE privilege before it looks whether the
// schema exists, and so kept it down.
func TestSchemaPrecreatedForTheRole(t *testing.T) {
	pg := pgtest.Start(t)
	pg.Exec(`CREATE ROLE limited_app LOGIN`)
	pg.Exec(`CREATE SCHEMA onceproxy AUTHORIZATION limited_app`)
	url := strings.Replace(pg.URL, "postgres@", "limited_app@", 1)
	logs := &logbuf.Buffer{}
	logger := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	local := dedup.NewMemoryStore(1 << 20)
	defer local.Close()
	be, err := Open(Config{URL: url, Schema: "onceproxy", MaxConns: 4, FlightConns: 1, Timeout: 2 * time.Second}, local, logger)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	defer be.Close()
	if !be.Available() {
		t.Fatalf("the role owns the schema, but the shared layer is not available; logs:\n%s", logs.String())
	}
}

// TestStartingInstanceDoesNotStallFleetWrites: an instance starting (or
// re-running setup) once ran CREATE INDEX IF NOT EXISTS on the cache
// table, which takes a SHARE lock even when the index exists. Behind any
// open writer (the sweep's or a big row's delete, each allowed 10s, a
// DBA's UPDATE, autovacuum), that lock request queued, and every other
// instance's writes to the cache behind it. Now an index that exists is
// left alone: the instance starts at once, and the fleet's writes go on.
func TestStartingInstanceDoesNotStallFleetWrites(t *testing.T) {
	f := newFleet(t, 1, Config{}, dedup.Config{}, nil)
	a := f.insts[0]
	// A writer transaction on the cache table, open for a few seconds.
	holder := f.conn()
	ctx := context.Background()
	if _, err := holder.Exec(ctx, "BEGIN"); err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(ctx, schemaSQL(f.schema, `INSERT INTO {s}.cache VALUES ('held', '', ''::bytea, 0, now(), now() + interval '1 minute')`)); err != nil {
		t.Fatal(err)
	}
	defer holder.Exec(ctx, "ROLLBACK")

	// A second instance starts meanwhile (a rolling deploy).
	local := dedup.NewMemoryStore(1 << 20)
	t.Cleanup(local.Close)
	started := make(chan *Backend, 1)
	go func() {
		be, err := open(f.config(Config{}), local, slog.New(slog.NewTextHandler(f.logs, nil)), nil)
		if err != nil {
			started <- nil
			return
		}
		started <- be
	}()
	t.Cleanup(func() {
		if be := <-started; be != nil {
			be.Close()
		}
	})
	// It starts without waiting for the writer.
	select {
	case be := <-started:
		started <- be // for the cleanup
		if be == nil || !be.Available() {
			t.Fatal("the second instance did not start sharing")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the second instance's setup waits for a writer on the cache table")
	}
	// The running instance caches an unrelated response.
	errs := a.be.Errors()
	start := time.Now()
	e := entry("unrelated")
	_ = a.store.Set(ctx, "v1:ops-unrelated", e, time.Minute)
	took := time.Since(start)
	if took > time.Second || a.be.Errors() != errs {
		t.Fatalf("an unrelated write of a running instance took %s and failed %d statements while another instance started", took.Round(time.Millisecond), a.be.Errors()-errs)
	}
}

// TestJoinWaitsOnALostLockOfItsOwn: a Join for a key whose flight this
// instance still leads on a session whose connection ended (server
// restart, pg_terminate_backend) finds the key held here and free in the
// database. It waits for that flight, polling, instead of looking again at
// once in a busy loop of statements until the stale flight ends.
func TestJoinWaitsOnALostLockOfItsOwn(t *testing.T) {
	f := newFleet(t, 1, Config{}, dedup.Config{}, nil)
	a := f.insts[0]
	const key = "v1:ops-spin"
	l := lead(t, a, key)
	// The session's connection ends under the flight.
	terminateSession(t, f, l.sess)
	time.Sleep(200 * time.Millisecond)
	a.trace.take()

	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	l2, out, err := a.store.Join(ctx, key)
	if l2 != nil {
		l2.Release()
	}
	stmts, trips := a.trace.take()
	l.Release()
	t.Logf("join: lease %v out %v err %v; %d round trips in 500ms", l2 != nil, out, err, trips)
	// poll_interval is 100ms: a waiter sends a handful of statements in
	// 500ms.
	if trips > 20 {
		t.Fatalf("a Join sent %d statements in 500ms (first: %q)", trips, stmts[0])
	}
}

// TestGarbageCounterKeepsTheBreakerClosed: one counters row this build
// never writes (n at the bigint maximum, from another version or psql)
// must not fail the rate limiter's statement on its key ("bigint out of
// range"), which the breaker would count as the database failing: after
// breaker_failures hits of that one client, the whole shared layer would
// be switched off. The client is held back for one burst at most.
func TestGarbageCounterKeepsTheBreakerClosed(t *testing.T) {
	f := newFleet(t, 1, Config{BreakerInterval: time.Minute}, dedup.Config{}, nil)
	a := f.insts[0]
	f.exec(`INSERT INTO {s}.counters VALUES ('client-x', 9223372036854775807, now() + interval '1 minute')`)
	for range 5 {
		ahead, ok, err := a.bus.Take(context.Background(), "client-x", time.Second, time.Minute)
		if err != nil || ok || ahead != time.Minute {
			t.Errorf("Take on a row at the bigint maximum: %s %v %v, want refused, a burst (1m) ahead", ahead, ok, err)
		}
	}
	if !a.be.Available() {
		t.Fatalf("one unreadable counters row switched the shared layer off (errors %d)", a.be.Errors())
	}
}

// TestSchemaThisRoleCannotSetUp: postgres.schema "pg_..." is
// refused by Validate (PostgreSQL refuses to create such a schema), and a
// schema this role may not create fails Open naming the key, instead of
// the instance running alone for good, the database logged as unreachable.
func TestSchemaThisRoleCannotSetUp(t *testing.T) {
	if err := (Config{URL: "postgres://x/y", Schema: "pg_onceproxy"}).WithDefaults().Validate(); err == nil || !strings.Contains(err.Error(), "schema:") {
		t.Errorf("Validate of schema pg_onceproxy: %v", err)
	}
	pg := pgtest.Start(t)
	pg.Exec(`CREATE ROLE weak_app LOGIN`)
	url := strings.Replace(pg.URL, "postgres@", "weak_app@", 1)
	local := dedup.NewMemoryStore(1 << 20)
	defer local.Close()
	be, err := Open(Config{URL: url, Schema: "onceproxy", MaxConns: 4, FlightConns: 1, Timeout: 2 * time.Second}, local,
		slog.New(slog.NewTextHandler(&logbuf.Buffer{}, nil)))
	if err == nil {
		be.Close()
		t.Fatal("Open succeeded for a role that may not create its schema")
	}
	if !strings.Contains(err.Error(), "postgres.schema") || !strings.Contains(err.Error(), "permission denied") {
		t.Errorf("Open error does not name the key and the cause: %v", err)
	}
}

// TestCounterFromElsewhereIsAtRest: a counters row far in the past (an
// old build's fixed-window count), counting below zero, or expired
// whatever it holds, is a client at rest: its burst is whole.
func TestCounterFromElsewhereIsAtRest(t *testing.T) {
	f := newFleet(t, 1, Config{}, dedup.Config{}, nil)
	a := f.insts[0]
	f.exec(`INSERT INTO {s}.counters VALUES ('far', 1000, now() + interval '10 years'), ('negative', -5, now() + interval '1 minute'),
		('expired', 9223372036854775807, now() - interval '1 second')`)
	for _, key := range []string{"far", "negative", "expired"} {
		for i := range 3 {
			if ahead, ok, err := a.bus.Take(context.Background(), key, time.Second, 2*time.Second); err != nil || ok != (i < 2) {
				t.Errorf("%s: take %d = %s %v %v, want a whole burst of 2", key, i+1, ahead, ok, err)
			}
		}
	}
}

// TestValuesAreStoredAsTheyCome: a value of a few KiB stays in its row (no
// TOAST), and a big one goes out of line without PostgreSQL compressing it
// again (values come compressed when compressing pays): each would cost a
// write CPU and inserts for nothing.
func TestValuesAreStoredAsTheyCome(t *testing.T) {
	f := newFleet(t, 1, Config{}, dedup.Config{}, func(http.ResponseWriter, *http.Request) {})
	a := f.insts[0]
	ctx := context.Background()
	random := func(n int) string {
		b := make([]byte, n)
		rand.Read(b)
		return hex.EncodeToString(b)[:n]
	}
	small := entry(random(4 << 10))
	small.Header.Set("Content-Type", "image/png") // stored as it is, not compressed by the codec
	if err := a.store.Set(ctx, "v1:small", small, time.Minute); err != nil {
		t.Fatal(err)
	}
	big := entry(strings.Repeat("compressible ", 4<<10))
	big.Header.Set("Content-Type", "image/png")
	if err := a.store.Set(ctx, "v1:big", big, time.Minute); err != nil {
		t.Fatal(err)
	}
	c := f.conn()
	var toast string
	if err := c.QueryRow(ctx, schemaSQL(f.schema, `SELECT reltoastrelid::regclass::text FROM pg_class WHERE oid = '{s}.cache'::regclass`)).Scan(&toast); err != nil {
		t.Fatal(err)
	}
	var chunks int
	var compressed *string
	if err := c.QueryRow(ctx, schemaSQL(f.schema, `SELECT (SELECT count(DISTINCT chunk_id) FROM `+toast+`),
		(SELECT pg_column_compression(value) FROM {s}.cache WHERE key = 'v1:big')`)).Scan(&chunks, &compressed); err != nil {
		t.Fatal(err)
	}
	if chunks != 1 || compressed != nil {
		t.Errorf("%d values out of line (want 1: the big one, not the 4 KiB one), the big one compressed with %v (want none)", chunks, deref(compressed))
	}
}

func deref(s *string) string {
	if s == nil {
		return "<nil>"
	}
	return *s
}

// TestStorageSettingsWaitForAQuietTable: a schema made by an earlier
// build gets the cache's storage settings at the first start of this one,
// an ALTER TABLE, whose lock must not stall the fleet: behind an open
// writer it gives up within half a second and the instance starts
// without them; a start once the table is quiet sets them.
func TestStorageSettingsWaitForAQuietTable(t *testing.T) {
	f := newFleet(t, 1, Config{}, dedup.Config{}, nil)
	ctx := context.Background()
	// The schema as an earlier build left it.
	f.exec(`ALTER TABLE {s}.cache ALTER COLUMN value SET STORAGE EXTENDED; ALTER TABLE {s}.cache RESET (toast_tuple_target)`)
	settings := func() string {
		t.Helper()
		var s string
		err := f.conn().QueryRow(ctx, schemaSQL(f.schema, `SELECT (SELECT attstorage::text FROM pg_attribute WHERE attrelid = '{s}.cache'::regclass AND attname = 'value')
			|| ' ' || coalesce((SELECT array_to_string(reloptions, ',') FROM pg_class WHERE oid = '{s}.cache'::regclass), '')`)).Scan(&s)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	start := func() time.Duration {
		t.Helper()
		local := dedup.NewMemoryStore(1 << 20)
		t.Cleanup(local.Close)
		began := time.Now()
		be, err := open(f.config(Config{}), local, slog.New(slog.NewTextHandler(f.logs, nil)), nil)
		took := time.Since(began)
		if err != nil {
			t.Fatalf("open: %v", err)
		}
		t.Cleanup(func() { be.Close() })
		if !be.Available() {
			t.Fatalf("the instance did not start sharing; logs:\n%s", f.logs.String())
		}
		return took
	}

	holder := f.conn()
	if _, err := holder.Exec(ctx, "BEGIN"); err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(ctx, schemaSQL(f.schema, `INSERT INTO {s}.cache VALUES ('held', '', ''::bytea, 0, now(), now() + interval '1 minute')`)); err != nil {
		t.Fatal(err)
	}
	if took := start(); took > 3*time.Second {
		t.Errorf("an instance took %s to start behind an open writer", took.Round(time.Millisecond))
	}
	if got := settings(); got != "x " {
		t.Errorf("settings %q behind an open writer, want the old ones (x)", got)
	}
	if _, err := holder.Exec(ctx, "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	start()
	if got := settings(); got != "e toast_tuple_target=8160" {
		t.Errorf("settings %q once the table is quiet, want e toast_tuple_target=8160", got)
	}
}
