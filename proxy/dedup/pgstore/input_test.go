package pgstore

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/seed-a3c387e8/onceproxy/internal/pgtest"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/storecodec"
)

// TestGarbageRowsAreIgnored: a cached value this build did not write (bad
// magic, truncated, another format version, a header no response can
// carry) is a miss that gets replaced, counted, never misread and never a
// panic.
func TestGarbageRowsAreIgnored(t *testing.T) {
	f := newFleet(t, 1, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "fresh")
	})
	inst := f.insts[0]
	good := storecodec.Encode(&dedup.Entry{Status: 200, Header: http.Header{"X": {"stale"}}, Body: []byte("stale"),
		StoredAt: time.Now(), ExpiresAt: time.Now().Add(time.Hour)})
	other := append([]byte(nil), good...)
	other[4] = storecodec.Version + 1
	crlf := storecodec.Encode(&dedup.Entry{Status: 200, Header: http.Header{"X": {"a\r\nSet-Cookie: evil=1"}}, Body: []byte("stale"),
		StoredAt: time.Now(), ExpiresAt: time.Now().Add(time.Hour)})
	for name, blob := range map[string][]byte{
		"bad magic":     append([]byte("NOPE"), good[4:]...),
		"truncated":     good[:len(good)-3],
		"other version": other,
		"header CRLF":   crlf,
		"empty":         {},
	} {
		t.Run(name, func(t *testing.T) {
			u := f.origin.URL + "/garbage/" + strings.ReplaceAll(name, " ", "-")
			key := inst.get(u).key // MISS, stored
			inst.local.Delete(context.Background(), key)
			f.exec(`UPDATE {s}.cache SET value = $2 WHERE key = $1`, key, blob)
			before := inst.be.Rejected()
			if g := inst.get(u); g.body != "fresh" || g.xcache != dedup.CacheMiss {
				t.Fatalf("garbage misread: %+v", g)
			}
			if inst.be.Rejected() <= before {
				t.Error("the garbage value was not counted")
			}
			if g := inst.get(u); g.body != "fresh" || g.xcache != dedup.CacheHit {
				t.Fatalf("replacement not stored: %+v", g)
			}
			var n int
			c := f.conn()
			if err := c.QueryRow(context.Background(), schemaSQL(f.schema, `SELECT count(*) FROM {s}.cache WHERE key = $1 AND value = $2`), key, blob).Scan(&n); err != nil || n != 0 {
				t.Fatalf("the garbage row is still there (%d, %v)", n, err)
			}
		})
	}
}

// TestGarbageOutcomeIsIgnored: while a waiter waits on a flight held
// elsewhere, an unreadable outcome is counted and dropped and the waiter
// keeps waiting; the readable outcome that follows is its answer.
func TestGarbageOutcomeIsIgnored(t *testing.T) {
	f := newFleet(t, 1, Config{PollInterval: 20 * time.Millisecond}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {})
	inst := f.insts[0]
	ctx := context.Background()
	const key = "v1:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	// A leader elsewhere: a session of the test's own holds the lock.
	leader := f.conn()
	var ok bool
	if err := leader.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", inst.store.lockID(key)).Scan(&ok); err != nil || !ok {
		t.Fatalf("lock: %v %v", ok, err)
	}
	type joined struct {
		out *dedup.Outcome
		err error
	}
	res := make(chan joined, 1)
	go func() {
		l, out, err := inst.store.Join(ctx, key)
		if l != nil {
			l.Release()
			err = errors.New("took a lock held elsewhere")
		}
		res <- joined{out, err}
	}()
	waitFor(t, "the join to wait", func() bool { return inst.store.fleetWaits.Load() == 1 })
	before := inst.be.Rejected()
	f.exec(`INSERT INTO {s}.outcomes VALUES ($1, $2, now() + interval '1 minute')`, key, []byte("Qnot an outcome"))
	waitFor(t, "the garbage outcome to be counted and dropped", func() bool {
		var n int
		_ = leader.QueryRow(ctx, schemaSQL(f.schema, `SELECT count(*) FROM {s}.outcomes WHERE key = $1`), key).Scan(&n)
		return inst.be.Rejected() > before && n == 0
	})
	select {
	case r := <-res:
		t.Fatalf("the waiter stopped on a garbage outcome: %+v", r)
	default:
	}
	f.exec(`INSERT INTO {s}.outcomes VALUES ($1, $2, now() + interval '1 minute')`, key,
		storecodec.EncodeOutcome(dedup.Outcome{Err: "origin refused", Timeout: true}))
	select {
	case r := <-res:
		if r.err != nil || r.out == nil || r.out.Err != "origin refused" || !r.out.Timeout || r.out.Entry != nil {
			t.Fatalf("join: %+v %v", r.out, r.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter never read the good outcome")
	}
}

// TestHostileNotificationsAreIgnored: whatever arrives on the channel or
// sits in the notes table (another version, a person with psql) is counted
// and ignored; the instance keeps serving and keeps hearing good notes.
func TestHostileNotificationsAreIgnored(t *testing.T) {
	f := newFleet(t, 1, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "page") })
	inst := f.insts[0]
	var mu sync.Mutex
	var heard []string
	inst.bus.Subscribe("session", func(msg string, _ time.Duration) {
		mu.Lock()
		heard = append(heard, msg)
		mu.Unlock()
	})
	ctx := context.Background()
	c := f.conn()
	notify := func(payload string) {
		t.Helper()
		if _, err := c.Exec(ctx, "SELECT pg_notify($1, $2)", inst.store.channel, payload); err != nil {
			t.Fatal(err)
		}
	}
	good := `{"session":"s1","kind":"rotated"}`
	waitFor(t, "the listener to hear a good note", func() bool {
		notify("n other session " + good)
		time.Sleep(20 * time.Millisecond)
		mu.Lock()
		defer mu.Unlock()
		return len(heard) > 0
	})
	garbage := []string{"", "x", "d", "d ", "zz top", "n", "n onlyinstance", "n other", "n other session", "\u00ff\u0001"}
	before := inst.be.Rejected()
	for _, g := range garbage {
		notify(g)
	}
	waitFor(t, "every garbage notification to be counted", func() bool {
		return inst.be.Rejected()-before == int64(len(garbage))
	})
	if g := inst.get(f.origin.URL + "/after"); g.status != 200 || g.body != "page" {
		t.Fatalf("after garbage notifications: %+v", g)
	}

	// Lasting notes onceproxy did not write: one that claims to last for a
	// century is counted and ignored, the good one is recalled.
	f.exec(`INSERT INTO {s}.notes VALUES ('session', 'a', 'forever', now() + interval '100 years'),
		('session', 'b', $1, now() + interval '1 hour'), ('session', 'c', 'gone', now() - interval '1 second')`, good)
	before = inst.be.Rejected()
	var recalledMsgs []string
	inst.bus.Subscribe("session", func(msg string, left time.Duration) {
		if left > 0 {
			recalledMsgs = append(recalledMsgs, msg)
		}
	})
	if len(recalledMsgs) != 1 || recalledMsgs[0] != good {
		t.Errorf("recalled %q, want only the good note", recalledMsgs)
	}
	if inst.be.Rejected()-before != 1 {
		t.Errorf("rejected %d recalled notes, want 1", inst.be.Rejected()-before)
	}
}

// FuzzEvent feeds arbitrary notifications to the dispatcher with no
// recover in between: a panic fails the fuzzer. A notification is either
// used or counted as rejected, never both and never neither.
func FuzzEvent(f *testing.F) {
	for _, s := range []string{"d v1:abc", "i v1:abc", "u u1:abc", "r v1:abc 99999999999999", "r v1:abc x", "n other session {}", "n me session x", "n", "q q", ""} {
		f.Add(s)
	}
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	c := &client{log: logger, instance: "me"}
	c.life, c.cancel = context.WithCancel(context.Background())
	defer c.cancel()
	local := dedup.NewMemoryStore(1 << 20)
	defer local.Close()
	b := &Backend{c: c, Cache: newCache(c, local), Bus: &Bus{client: c}}
	delivered := 0
	b.Bus.topics.Set("session", func(string, time.Duration) { delivered++ })
	// A waiter and a cached value, so wake-ups and invalidations have
	// something to act on.
	wake := b.Cache.waiters.Add("v1:abc", b.Cache.waiters.Mark("v1:abc"))
	f.Fuzz(func(t *testing.T, payload string) {
		_ = local.Set(context.Background(), "v1:abc", &dedup.Entry{Status: 200, Header: http.Header{}, URLKey: "u1:abc", StoredAt: time.UnixMilli(1000)}, time.Minute)
		before, rejected := delivered, c.rejected.Load()
		b.handleEventUnguarded(payload)
		used := delivered > before
		kind, arg, ok := strings.Cut(payload, " ")
		wellFormed := ok && arg != "" && (kind == "d" || kind == "i" || kind == "u" || kind == "n")
		if kind == "r" {
			key, at, ok2 := strings.Cut(arg, " ")
			_, err := strconv.ParseInt(at, 10, 64)
			wellFormed = ok && ok2 && key != "" && err == nil
		}
		if c.rejected.Load() > rejected && used {
			t.Fatalf("%q was both delivered and rejected", payload)
		}
		if !wellFormed && c.rejected.Load() == rejected {
			t.Fatalf("%q was not rejected", payload)
		}
		_, err := local.Get(context.Background(), "v1:abc")
		replacedByNewer := false
		if key, at, ok := strings.Cut(strings.TrimPrefix(payload, "r "), " "); strings.HasPrefix(payload, "r ") && ok && key == "v1:abc" {
			ms, err := strconv.ParseInt(at, 10, 64)
			replacedByNewer = err == nil && ms > 1000 // the cached copy's fetch time
		}
		if gone := err != nil; gone != (payload == "i v1:abc" || payload == "u u1:abc" || replacedByNewer) {
			t.Fatalf("%q: cached value gone = %v", payload, gone)
		}
		select {
		case <-wake:
			if payload != "d v1:abc" {
				t.Fatalf("%q woke the waiter of v1:abc", payload)
			}
		default:
			if payload == "d v1:abc" {
				t.Fatal("the flight's end did not wake its waiter")
			}
		}
	})
}

// FuzzRecalledNote: what a notes row says is left of it; what is accepted
// has a positive, bounded time left, the message unchanged.
func FuzzRecalledNote(f *testing.F) {
	f.Add("msg", int64(1000))
	f.Add("msg", int64(-1))
	f.Add("", int64(1<<62))
	f.Fuzz(func(t *testing.T, msg string, ms int64) {
		n, ok := recalledNote(msg, ms)
		if ok != (ms > 0 && ms <= int64(maxLasting/time.Millisecond)) {
			t.Fatalf("%d ms: accepted = %v", ms, ok)
		}
		if ok && (n.left <= 0 || n.left > maxLasting || n.msg != msg) {
			t.Fatalf("accepted %+v", n)
		}
	})
}

// TestSchemaOfAnotherVersionIsRefused: a schema written by another version
// of onceproxy, or one that is not onceproxy's, stops Open with an error
// that says so; the right version opens, again and again.
func TestSchemaOfAnotherVersionIsRefused(t *testing.T) {
	url, _ := pgtest.Schema(t)
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	open := func(schema string) error {
		local := dedup.NewMemoryStore(1 << 20)
		defer local.Close()
		be, err := Open(Config{URL: url, Schema: schema}, local, logger)
		if err == nil {
			be.Close()
		}
		return err
	}
	newer := pgtest.SchemaName(t)
	t.Cleanup(func() { pgtest.Exec(t, url, "DROP SCHEMA IF EXISTS "+newer+" CASCADE") })
	pgtest.Exec(t, url, "CREATE SCHEMA "+newer+"; CREATE TABLE "+newer+".meta (name text PRIMARY KEY, value text NOT NULL);"+
		"INSERT INTO "+newer+".meta VALUES ('schema_version', '2')")
	err := open(newer)
	if !errors.Is(err, errSchema) || !strings.Contains(err.Error(), `version "2"`) || !strings.Contains(err.Error(), "postgres.schema") {
		t.Fatalf("schema version 2: err = %v", err)
	}

	foreign := pgtest.SchemaName(t)
	t.Cleanup(func() { pgtest.Exec(t, url, "DROP SCHEMA IF EXISTS "+foreign+" CASCADE") })
	pgtest.Exec(t, url, "CREATE SCHEMA "+foreign+"; CREATE TABLE "+foreign+".cache (id int)")
	if err := open(foreign); !errors.Is(err, errSchema) || !strings.Contains(err.Error(), "not onceproxy's") {
		t.Fatalf("a schema that is not onceproxy's: err = %v", err)
	}

	mine := pgtest.SchemaName(t)
	t.Cleanup(func() { pgtest.Exec(t, url, "DROP SCHEMA IF EXISTS "+mine+" CASCADE") })
	for i := range 2 {
		if err := open(mine); err != nil {
			t.Fatalf("open %d of a fresh schema: %v", i+1, err)
		}
	}
	// Versioned: the meta table says which layout the schema holds.
	c, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	var v string
	if err := c.QueryRow(context.Background(), "SELECT value FROM "+mine+".meta WHERE name = 'schema_version'").Scan(&v); err != nil || v != "1" {
		t.Fatalf("schema_version %q, %v", v, err)
	}
}

// TestSchemaChangedUnderARunningInstance: an instance whose schema is
// replaced by another version while it runs stops sharing (and says so)
// instead of misreading it.
func TestSchemaChangedUnderARunningInstance(t *testing.T) {
	f := newFleet(t, 1, Config{BreakerFailures: 1, BreakerInterval: 100 * time.Millisecond}, dedup.Config{},
		func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "page") })
	inst := f.insts[0]
	f.exec(`UPDATE {s}.meta SET value = '9' WHERE name = 'schema_version'; DROP TABLE {s}.cache`)
	waitFor(t, "the instance to stop sharing", func() bool {
		g := inst.get(f.origin.URL + "/x" + time.Now().String())
		if g.err != nil || g.status != 200 {
			t.Fatalf("a request failed: %+v", g)
		}
		return !inst.be.Available() && inst.store.refused.Load()
	})
	if g := inst.get(f.origin.URL + "/after"); g.status != 200 || g.xcache != dedup.CacheBypass {
		t.Fatalf("after the refusal: %+v", g)
	}
	if !strings.Contains(f.logs.String(), "schema refused") {
		t.Error("the refusal was not logged")
	}
}
