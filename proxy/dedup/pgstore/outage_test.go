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

	"go.uber.org/goleak"

	"github.com/seed-a3c387e8/onceproxy/internal/pgtest"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/storecodec"
)

// TestOutageDuringLoad: PostgreSQL stopped under steady load costs
// savings, never requests; what goes upstream meanwhile says BYPASS; after
// a restart shared HITs resume within the breaker interval; nothing leaks.
func TestOutageDuringLoad(t *testing.T) {
	// Registered first, so it runs after every other cleanup of the test.
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, ignore) })
	pg := pgtest.Start(t)
	const interval = 400 * time.Millisecond
	f := newFleetOn(t, pg, 2, Config{BreakerInterval: interval, BreakerFailures: 2, Timeout: 500 * time.Millisecond}, dedup.Config{TTL: 30 * time.Second},
		func(w http.ResponseWriter, r *http.Request) {
			time.Sleep(2 * time.Millisecond)
			fmt.Fprintf(w, "page %s", r.URL.RequestURI())
		})
	a, b := f.insts[0], f.insts[1]

	var (
		mu     sync.Mutex
		counts = map[string]int{}
		errs   []string
	)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				inst := f.insts[(w+i)%2]
				g := inst.get(fmt.Sprintf("%s/load/%d", f.origin.URL, i%50))
				mu.Lock()
				if g.err != nil || g.status != 200 {
					errs = append(errs, fmt.Sprintf("%+v", g))
				}
				counts[g.xcache]++
				mu.Unlock()
			}
		})
	}
	time.Sleep(300 * time.Millisecond)
	pg.Stop()
	waitFor(t, "breaker open on both instances", func() bool { return !a.be.Available() && !b.be.Available() })
	for i, inst := range f.insts {
		g := inst.get(fmt.Sprintf("%s/during/%d", f.origin.URL, i))
		if g.err != nil || g.status != 200 || g.xcache != dedup.CacheBypass {
			t.Errorf("instance %d, new page while PostgreSQL is down: %+v, want 200 BYPASS", i, g)
		}
	}
	time.Sleep(300 * time.Millisecond) // load while PostgreSQL is down
	pg.Start()
	restarted := time.Now()
	waitFor(t, "shared HITs to resume", func() bool {
		u := fmt.Sprintf("%s/after/%d", f.origin.URL, time.Now().UnixNano())
		if g := a.get(u); g.xcache != dedup.CacheMiss {
			return false
		}
		return b.get(u).xcache == dedup.CacheHit
	})
	resumed := time.Since(restarted)
	close(stop)
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("%d client requests failed during the outage, first: %s", len(errs), errs[0])
	}
	t.Logf("X-Cache during the run: %v; shared HITs resumed %s after the restart", counts, resumed)
	if resumed > interval+2*time.Second {
		t.Fatalf("the shared layer took %s to come back (breaker interval %s)", resumed, interval)
	}
	for _, inst := range f.insts {
		inst.stop()
	}
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
	pg := pgtest.Start(t)
	f := newFleetOn(t, pg, 1, Config{BreakerInterval: 200 * time.Millisecond, Timeout: 200 * time.Millisecond}, dedup.Config{},
		func(w http.ResponseWriter, r *http.Request) {})
	inst := f.insts[0]
	if !inst.be.Available() {
		t.Fatal("not available at start")
	}
	pg.Stop()
	waitFor(t, "the idle instance to see the outage", func() bool { return !inst.be.Available() })
	pg.Start()
	waitFor(t, "the idle instance to see the database back", inst.be.Available)
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
