package pgstore

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestSlowBodyValueExpiresWithItsRow: a value whose body took a while to
// arrive expires at its own ExpiresAt (counted from the response headers),
// and so does its row. A row that outlived its value would be found by
// every instance and refused by each as expired: each would give up on
// the fleet (errUnreadable) and fetch on its own, and a stampede on three
// instances would cost three origin requests instead of one.
func TestSlowBodyValueExpiresWithItsRow(t *testing.T) {
	const ttl = 3 * time.Second
	const bodyDelay = 1500 * time.Millisecond
	f := newFleet(t, 3, Config{}, dedup.Config{TTL: ttl}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "4")
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		time.Sleep(bodyDelay) // headers at once, the body later
		fmt.Fprint(w, "body")
	})
	u := f.origin.URL + "/slow"
	if g := f.insts[0].get(u); g.err != nil || g.xcache != dedup.CacheMiss {
		t.Fatalf("first request: %+v", g)
	}
	start := time.Now()
	// Past the value's ExpiresAt (headers + ttl), before the row's
	// expiry (finish + ttl).
	time.Sleep(ttl - bodyDelay + 500*time.Millisecond)
	if time.Since(start) > ttl {
		t.Skip("too slow to land in the window")
	}
	before := f.hits.Load()
	var wg sync.WaitGroup
	res := make([]got, len(f.insts))
	for i, inst := range f.insts {
		wg.Add(1)
		go func() { defer wg.Done(); res[i] = inst.get(u) }()
	}
	wg.Wait()
	for i, g := range res {
		t.Logf("instance %d: %s err=%v", i, g.xcache, g.err)
	}
	if n := f.hits.Load() - before; n != 1 {
		t.Fatalf("a stampede on 3 instances after the value expired cost %d origin requests, want 1 (logs say why: %q)",
			n, "gave up waiting on another instance's flight")
	}
}

// TestGarbageStatsRowKeepsTheBreakerClosed: a stats row for today this
// build never writes (a count at the bigint maximum, from another version
// or psql) saturates instead of failing every flush with "bigint out of
// range", which the breaker would count as the database failing and
// switch the shared layer off (as TestGarbageCounterKeepsTheBreakerClosed
// for the counters table).
func TestGarbageStatsRowKeepsTheBreakerClosed(t *testing.T) {
	f := newFleet(t, 1, Config{BreakerInterval: time.Minute, StatsFlush: time.Hour}, dedup.Config{}, nil)
	a := f.insts[0]
	f.exec(`INSERT INTO {s}.stats (day, hit) VALUES ($1, 9223372036854775807)`, day(time.Now()))
	errs := a.be.Errors()
	for range 5 {
		a.bus.Record(dedup.CacheHit, 0, 0)
		a.bus.flushOnce(context.Background())
	}
	if !a.be.Available() {
		t.Fatalf("one unreadable stats row switched the shared layer off (%d statement errors)", a.be.Errors()-errs)
	}
}

// TestLongLastingNoteSendsNoEmptyNotification: a lasting note too long to
// notify is kept in the table, and no empty notification goes out in its
// place, which every instance of the fleet would count as rejected
// (garbage) input.
func TestLongLastingNoteSendsNoEmptyNotification(t *testing.T) {
	f := newFleet(t, 2, Config{}, dedup.Config{}, nil)
	a, b := f.insts[0], f.insts[1]
	var heard sync.Mutex
	got := 0
	b.bus.Subscribe("review", func(string, time.Duration) { heard.Lock(); got++; heard.Unlock() })
	// b's listener is live once it hears a short note.
	waitFor(t, "b to hear a", func() bool {
		a.bus.Publish("review", "", "short", 0)
		time.Sleep(20 * time.Millisecond)
		heard.Lock()
		defer heard.Unlock()
		return got > 0
	})
	before := b.be.Rejected()
	a.bus.Publish("review", "k", strings.Repeat("x", maxPayload), time.Minute)
	c := f.conn()
	if !within(10*time.Second, func() bool {
		var n int
		_ = c.QueryRow(context.Background(), schemaSQL(f.schema, `SELECT count(*) FROM {s}.notes WHERE topic = 'review'`)).Scan(&n)
		return n == 1
	}) {
		t.Fatal("the lasting note was not kept")
	}
	// Let the listener hear whatever was sent with it.
	time.Sleep(500 * time.Millisecond)
	if n := b.be.Rejected() - before; n != 0 {
		t.Fatalf("another instance counted %d rejected notifications after a long lasting note", n)
	}
}

// TestSweepKeepsUpWithSteadyMisses: a sweep goes on while there is work
// (for half an interval at most), so a fleet writing more rows per
// sweep_interval than sweepRounds × sweepBatch (three PostgreSQL instances
// at their measured 1,000+ misses/s each) does not outrun it: the excess
// over max_bytes stays within what the fleet writes in one interval
// (README) instead of growing with every interval.
func TestSweepKeepsUpWithSteadyMisses(t *testing.T) {
	const maxBytes = 64 * bytesize.KiB
	const perInterval = 30_000 // rows written by the fleet per sweep_interval
	const rowBytes = 100
	f := newFleet(t, 1, Config{MaxBytes: maxBytes, MaxValueBytes: bytesize.KiB, SweepInterval: time.Hour}, dedup.Config{}, nil)
	inst := f.insts[0]
	c := f.conn()
	ctx := context.Background()
	var excess int64
	for round := range 4 {
		f.exec(`INSERT INTO {s}.cache SELECT 'v1:r' || $1::int || '-' || g, '', repeat('x', $3)::bytea, $3,
			now() + g * interval '1 microsecond', now() + interval '1 hour' FROM generate_series(1, $2) g`,
			round, perInterval, rowBytes)
		inst.be.sweep.once(ctx)
		var total int64
		if err := c.QueryRow(ctx, schemaSQL(f.schema, `SELECT coalesce(sum(size), 0) FROM {s}.cache`)).Scan(&total); err != nil {
			t.Fatal(err)
		}
		excess = total - int64(maxBytes)
		t.Logf("interval %d: %d bytes over max_bytes after the sweep", round, excess)
	}
	if written := int64(perInterval * rowBytes); excess > written {
		t.Fatalf("after 4 intervals the table exceeds max_bytes by %d bytes, more than the %d the fleet writes in one interval: the sweep never catches up", excess, written)
	}
}
