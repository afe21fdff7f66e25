package pgstore

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fleettest"
	"github.com/seed-a3c387e8/onceproxy/internal/pgtest"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/storecodec"
)

// TestOutageDuringLoad: PostgreSQL stopped under steady load costs
// savings, never requests; what goes upstream meanwhile says BYPASS; after
// a restart shared HITs resume within the breaker interval; nothing leaks.
func TestOutageDuringLoad(t *testing.T) {
	fleettest.OutageDuringLoad(t, contract(Config{Timeout: 500 * time.Millisecond}, nil))
}

// TestOutageKeepsWholeTTLsAndShares: while PostgreSQL is away the memory
// store is the cache, for whole TTLs (not local_ttl); once it is back,
// what was cached meanwhile is shared with the fleet, and where two
// instances cached one key the newer copy wins, also over the older one's
// own memory tier.
func TestOutageKeepsWholeTTLsAndShares(t *testing.T) {
	pg := pgtest.Start(t)
	var n atomic.Int64
	f := newFleetOn(t, pg, 2, Config{BreakerInterval: 200 * time.Millisecond, BreakerFailures: 1, LocalTTL: 50 * time.Millisecond},
		dedup.Config{TTL: time.Minute}, func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprintf(w, "%s #%d", r.URL.Path, n.Add(1))
		})
	a, b := f.insts[0], f.insts[1]
	pg.Stop()
	for _, inst := range f.insts {
		waitFor(t, inst.name+"'s breaker to open", func() bool {
			inst.get(fmt.Sprintf("%s/probe/%d", f.origin.URL, time.Now().UnixNano()))
			return !inst.be.Available()
		})
	}
	older := a.get(f.origin.URL + "/both")
	time.Sleep(10 * time.Millisecond)
	newer := b.get(f.origin.URL + "/both")
	onlyA := a.get(f.origin.URL + "/only-a")
	for _, g := range []got{older, newer, onlyA} {
		if g.status != 200 || g.xcache != dedup.CacheBypass {
			t.Fatalf("during the outage: %+v, want 200 BYPASS", g)
		}
	}
	time.Sleep(200 * time.Millisecond) // four local_ttl
	if g := a.get(f.origin.URL + "/both"); g.xcache != dedup.CacheHit || g.body != older.body {
		t.Fatalf("A after local_ttl, still down: %+v, want its own copy as a HIT", g)
	}

	pg.Start()
	waitFor(t, "both instances to share what they cached", func() bool {
		return a.be.Available() && b.be.Available() && a.store.pending.len() == 0 && b.store.pending.len() == 0
	})
	if g := b.get(f.origin.URL + "/only-a"); g.xcache != dedup.CacheHit || g.body != onlyA.body {
		t.Errorf("B after the outage: %+v, want A's copy (%q) as a HIT", g, onlyA.body)
	}
	// The newer copy wins everywhere, at once where the notification of
	// the newer copy's arrival has been heard, within local_ttl anyway.
	for _, inst := range f.insts {
		waitFor(t, inst.name+" to serve the newer copy", func() bool {
			g := inst.get(f.origin.URL + "/both")
			if g.xcache != dedup.CacheHit {
				t.Fatalf("%s after the outage: %+v, want a HIT", inst.name, g)
			}
			return g.body == newer.body
		})
	}
	stored, err := storecodec.Decode(f.row(older.key))
	if err != nil || string(stored.Body) != newer.body {
		t.Fatalf("the database holds %q (%v), want the newer %q", stored.Body, err, newer.body)
	}
	if n.Load() != 5 { // two probes, /both twice, /only-a
		t.Errorf("origin saw %d requests, want 5", n.Load())
	}
}

// row reads a cached value as stored.
func (f *fleetFixture) row(key string) []byte {
	f.t.Helper()
	var v []byte
	if err := f.conn().QueryRow(context.Background(), schemaSQL(f.schema, `SELECT value FROM {s}.cache WHERE key = $1`), key).Scan(&v); err != nil {
		f.t.Fatalf("row %s: %v", key, err)
	}
	return v
}

// TestDownAtStart: the proxy starts and serves without PostgreSQL, then
// joins the fleet when it appears, without any request to notice it.
func TestDownAtStart(t *testing.T) {
	pg := pgtest.Start(t)
	pg.Stop()
	local := dedup.NewMemoryStore(1 << 20)
	defer local.Close()
	be, err := Open(Config{URL: pg.URL, BreakerInterval: 200 * time.Millisecond}, local, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatalf("Open with PostgreSQL down: %v", err)
	}
	defer be.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); be.Run(ctx) }()
	defer func() { cancel(); <-done }()
	if be.Available() {
		t.Fatal("available without a database")
	}
	if _, _, err := be.Cache.Join(ctx, "v1:ab"); err == nil {
		t.Fatal("Join succeeded without PostgreSQL")
	}
	pg.Start()
	waitFor(t, "the idle instance to find the database", be.Available)
	lease, _, err := be.Cache.Join(ctx, "v1:cd")
	if err != nil || lease == nil {
		t.Fatalf("Join after the database appeared: %v %v", lease, err)
	}
	lease.Release()
}

// TestIdleInstanceFollowsTheDatabase: an instance without traffic notices
// an outage and the return of the database by itself, so /health
// (store_available) tells the truth.
func TestIdleInstanceFollowsTheDatabase(t *testing.T) {
	fleettest.IdleInstanceFollowsTheStore(t, contract(Config{BreakerInterval: 200 * time.Millisecond, Timeout: 200 * time.Millisecond}, nil))
}

// TestListenerReconnectRecallsLastingNotes: a lasting note kept while an
// instance could not hear it (here: written without a notification)
// reaches it when its listener comes back.
func TestListenerReconnectRecallsLastingNotes(t *testing.T) {
	f := newFleet(t, 1, Config{BreakerInterval: 200 * time.Millisecond}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {})
	inst := f.insts[0]
	var mu sync.Mutex
	var recalled []string
	inst.bus.Subscribe("session", func(msg string, left time.Duration) {
		if left > 0 {
			mu.Lock()
			recalled = append(recalled, msg)
			mu.Unlock()
		}
	})
	f.exec(`INSERT INTO {s}.notes VALUES ('session', 's1', 'kept meanwhile', now() + interval '1 minute')`)
	// End the listener's session, as a network cut would.
	c := f.conn()
	listen := "listen " + `"` + inst.store.channel + `"`
	waitFor(t, "the listener's session to end", func() bool {
		var n int
		err := c.QueryRow(context.Background(), `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE query = $1`, listen).Scan(&n)
		return err == nil && n == 1
	})
	waitFor(t, "the note to be recalled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, m := range recalled {
			if m == "kept meanwhile" {
				return true
			}
		}
		return false
	})
}
