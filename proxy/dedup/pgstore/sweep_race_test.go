package pgstore

import (
	"context"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestSweepKeepsARowRenewedWhileItRuns: a row the sweep's snapshot saw
// expired, but that another instance renewed (a claim taken again after
// it expired, a value stored again) and committed while the sweep waited
// for its row lock, is live: the sweep must not delete it. Deleting the
// renewed claim lets a second instance claim the same name while the first
// holds it; deleting the renewed value costs the fleet a fetch.
func TestSweepKeepsARowRenewedWhileItRuns(t *testing.T) {
	f := newFleet(t, 2, Config{SweepInterval: time.Hour}, dedup.Config{},
		func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "x") })
	a, b := f.insts[0], f.insts[1]
	ctx := context.Background()
	c, mon := f.conn(), f.conn()
	// renewWhileSweeping runs renew in a transaction that commits while
	// B's sweep waits for the row renew locked.
	renewWhileSweeping := func(renew func(tx pgx.Tx)) {
		tx, err := c.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		renew(tx)
		sweepBehind(t, b.be, tx, mon)
	}
	count := func(sql string) int {
		var n int
		if err := c.QueryRow(ctx, schemaSQL(f.schema, sql)).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	// A takes an expired claim again.
	f.exec(`INSERT INTO {s}.claims VALUES ('rotate', 'old', now() - interval '1 second')`)
	renewWhileSweeping(func(tx pgx.Tx) {
		var won bool
		if err := tx.QueryRow(ctx, a.bus.sql.claim, "rotate", "a-token", time.Hour.Milliseconds()).Scan(&won); err != nil || !won {
			t.Fatalf("A's claim: %v %v", won, err)
		}
	})
	if count(`SELECT count(*) FROM {s}.claims WHERE name = 'rotate'`) != 1 {
		t.Errorf("the sweep deleted A's live claim (taken for an hour)")
	}
	// The consequence: another instance gets the claim A holds.
	if release, ok := b.bus.Claim(ctx, "rotate", time.Hour); ok {
		release()
		t.Errorf("B claimed %q while A holds it for an hour", "rotate")
	}

	// A stores an expired key again.
	f.exec(`INSERT INTO {s}.cache VALUES ('v1:renewed', '', '\x00', 1, now(), now() - interval '1 second')`)
	renewWhileSweeping(func(tx pgx.Tx) {
		if _, err := tx.Exec(ctx, a.store.sql.set, "v1:renewed", "", []byte{1}, time.Now(), time.Hour.Milliseconds(), "none", "x"); err != nil {
			t.Fatal(err)
		}
	})
	if count(`SELECT count(*) FROM {s}.cache WHERE key = 'v1:renewed'`) != 1 {
		t.Errorf("the sweep deleted a live value (stored for an hour)")
	}
}

// TestEvictionKeepsARowStoredWhileItRuns: a value stored again (now the
// newest of the table) while the eviction waited for its row must not be
// evicted as one of the oldest, which its old version was.
func TestEvictionKeepsARowStoredWhileItRuns(t *testing.T) {
	f := newFleet(t, 1, Config{SweepInterval: time.Hour, MaxValueBytes: 1024, MaxBytes: 1024}, dedup.Config{},
		func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "x") })
	a := f.insts[0]
	ctx := context.Background()
	f.exec(`INSERT INTO {s}.cache SELECT 'v1:' || i, '', '\x00', 600, now() - (10 - i) * interval '1 minute', now() + interval '1 hour'
		FROM generate_series(1, 3) i`)
	c, mon := f.conn(), f.conn()
	tx, err := c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// v1:1, the oldest, is fetched and stored again: now the newest.
	if _, err := tx.Exec(ctx, a.store.sql.set, "v1:1", "", make([]byte, 600), time.Now(), time.Hour.Milliseconds(), "none", "x"); err != nil {
		t.Fatal(err)
	}
	sweepBehind(t, a.be, tx, mon)
	var n int
	if err := c.QueryRow(ctx, schemaSQL(f.schema, `SELECT count(*) FROM {s}.cache WHERE key = 'v1:1'`)).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Errorf("the sweep evicted the value stored last, as if it were the oldest")
	}
}

// sweepBehind runs be's sweep while tx holds the rows it wrote, and
// commits tx once the sweep waits for one of them (mon watches for that);
// it returns when the sweep is done.
func sweepBehind(t *testing.T, be *Backend, tx pgx.Tx, mon *pgx.Conn) {
	t.Helper()
	ctx := t.Context()
	swept := make(chan struct{})
	go func() {
		defer close(swept)
		be.sweep.once(ctx)
	}()
	waitFor(t, "the sweep to wait for a row the transaction wrote", func() bool {
		var n int
		_ = mon.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%.sweep(%'`).Scan(&n)
		return n > 0
	})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	<-swept
}
