package dedup

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// twoTiers is a TieredStore: a memory tier of this process in front of a
// "shared" one, counting how the engine reads them.
type twoTiers struct {
	*MemoryStore // this process's tier
	shared       *MemoryStore
	gets, locals atomic.Int64
}

func (s *twoTiers) Get(ctx context.Context, key string) (*Entry, error) {
	s.gets.Add(1)
	if e, err := s.MemoryStore.Get(ctx, key); err == nil {
		return e, nil
	}
	return s.shared.Get(ctx, key)
}

func (s *twoTiers) GetLocal(ctx context.Context, key string) (*Entry, error) {
	s.locals.Add(1)
	return s.MemoryStore.Get(ctx, key)
}

// sharedFleet answers Join from the shared tier, like a fleet whose join
// reads the shared value in the round trip that would take the lease.
// Joins wait for gate to close.
type sharedFleet struct {
	tiers *twoTiers
	gate  chan struct{}
	joins atomic.Int64
}

func (f *sharedFleet) Join(ctx context.Context, key string) (Lease, *Outcome, error) {
	f.joins.Add(1)
	<-f.gate
	if e, err := f.tiers.shared.Get(ctx, key); err == nil {
		return nil, &Outcome{Entry: e, Cached: true}, nil
	}
	return sharedLease{f.tiers, key}, nil, nil
}

type sharedLease struct {
	tiers *twoTiers
	key   string
}

func (l sharedLease) Finish(ctx context.Context, out Outcome, ttl time.Duration) error {
	if out.Entry != nil && ttl > 0 {
		return l.tiers.shared.Set(ctx, l.key, out.Entry, ttl)
	}
	return nil
}
func (sharedLease) Release() {}

// TestTieredStoreWithFleet: with a Fleet, the engine reads only this
// process's tier before a flight and lets Join find a shared value (a HIT,
// for everyone waiting on that flight); a HEAD still looks for a cached GET
// in the whole store.
func TestTieredStoreWithFleet(t *testing.T) {
	var upstream atomic.Int64
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		upstream.Add(1)
		io.WriteString(w, "page "+r.URL.Path)
	}))
	defer origin.Close()
	tiers := &twoTiers{MemoryStore: NewMemoryStore(1 << 20), shared: NewMemoryStore(1 << 20)}
	defer tiers.Close()
	defer tiers.shared.Close()
	fleet := &sharedFleet{tiers: tiers, gate: make(chan struct{})}
	cfg := Config{Enabled: true, TTL: time.Minute}.WithDefaults()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	eng, err := New(cfg, Options{Store: tiers, Fleet: fleet, Next: tr, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	do := func(method, path string) (*http.Response, error) {
		req, _ := http.NewRequest(method, origin.URL+path, nil)
		resp, err := eng.RoundTrip(req)
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		return resp, err
	}

	// A miss is stored in the shared tier through the lease.
	close(fleet.gate)
	if resp, err := do(http.MethodGet, "/p"); err != nil || resp.Header.Get(HeaderCache) != CacheMiss {
		t.Fatalf("first: %v %v", resp, err)
	}
	// The lease stores it just after the client has it.
	testkit.Eventually(t, testkit.Patience, func() bool { return eng.Stats().Flights == 0 }, "the flight to end")
	key := ""
	for k := range tiers.shared.c.Keys() {
		key = k
	}
	if key == "" {
		t.Fatal("the lease stored nothing in the shared tier")
	}
	// Another process's view: nothing in this process's tier.
	tiers.MemoryStore.Delete(context.Background(), key)
	tiers.gets.Store(0)

	// Five clients at once on a value only the shared tier has: one Join,
	// five HITs, no full Get.
	fleet.gate = make(chan struct{})
	fleet.joins.Store(0)
	const n = 5
	var wg sync.WaitGroup
	labels := make(chan string, n)
	for range n {
		wg.Go(func() {
			resp, err := do(http.MethodGet, "/p")
			if err != nil {
				labels <- err.Error()
				return
			}
			labels <- resp.Header.Get(HeaderCache) + " age=" + resp.Header.Get("Age")
		})
	}
	deadline := time.Now().Add(5 * time.Second)
	for eng.Stats().Waiters != n && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	close(fleet.gate)
	wg.Wait()
	close(labels)
	for l := range labels {
		if l != CacheHit+" age=0" {
			t.Errorf("client got %q, want a HIT", l)
		}
	}
	if j := fleet.joins.Load(); j != 1 {
		t.Errorf("%d joins, want 1", j)
	}
	if g := tiers.gets.Load(); g != 0 {
		t.Errorf("the engine read the whole store %d times before the flight; Join reads the shared tier", g)
	}

	// A HEAD: the GET is in the shared tier only; the whole store answers.
	tiers.MemoryStore.Delete(context.Background(), key)
	fleet.joins.Store(0)
	if resp, err := do(http.MethodHead, "/p"); err != nil || resp.Header.Get(HeaderCache) != CacheHit {
		t.Fatalf("HEAD: %v %v", resp, err)
	}
	if fleet.joins.Load() != 0 || upstream.Load() != 1 {
		t.Errorf("HEAD joined %d flights, origin saw %d requests", fleet.joins.Load(), upstream.Load())
	}
}
