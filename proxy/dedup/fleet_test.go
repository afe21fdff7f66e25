package dedup

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// memFleet is a Fleet for engines in one test process: the first Join of
// a key gets the lease, later ones wait for its outcome. It stands in for
// a shared store at the seam.
type memFleet struct {
	mu      sync.Mutex
	flights map[string]chan Outcome
}

func (m *memFleet) Join(ctx context.Context, key string) (Lease, *Outcome, error) {
	m.mu.Lock()
	ch, waiting := m.flights[key]
	if !waiting {
		ch = make(chan Outcome, 1)
		m.flights[key] = ch
	}
	m.mu.Unlock()
	if !waiting {
		return &memLease{m: m, key: key, ch: ch}, nil, nil
	}
	select {
	case out := <-ch:
		ch <- out // for the next waiter
		return nil, &out, nil
	case <-ctx.Done():
		return nil, nil, ctx.Err()
	}
}

type memLease struct {
	m    *memFleet
	key  string
	ch   chan Outcome
	once sync.Once
}

func (l *memLease) Finish(_ context.Context, out Outcome, _ time.Duration) error {
	l.once.Do(func() { l.ch <- out })
	return nil
}

func (l *memLease) Release() { l.once.Do(func() { l.ch <- Outcome{Err: "released"} }) }

// TestFleetBigBodyFetchedByEachInstance: two instances share flights. A
// body over max_body_bytes cannot go through the shared store, so the
// other instance is told at the leader's headers, not at the end of its
// download, and fetches its own copy; a small body is shared (COALESCED).
func TestFleetBigBodyFetchedByEachInstance(t *testing.T) {
	big := pattern(1 << 20)
	var hits atomic.Int64
	otherDone := make(chan struct{})
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := hits.Add(1)
		if r.URL.Path == "/small" {
			w.Write([]byte("small body"))
			return
		}
		w.Header().Set("Content-Length", strconv.Itoa(len(big)))
		writeSlowly(w, big[:64<<10])
		if n == 1 {
			// The leader's download ends only after the other instance
			// has its copy: waiting for the end would never finish.
			<-otherDone
		}
		writeSlowly(w, big[64<<10:])
	}))
	defer origin.Close()
	fleet := &memFleet{flights: map[string]chan Outcome{}}
	engine := func() *Engine {
		cfg := streamConfig(t, Config{Enabled: true, MaxBodyBytes: 64 * bytesize.KiB})
		store := NewMemoryStore(1 << 20)
		t.Cleanup(store.Close)
		eng, err := New(cfg, Options{Store: store, Next: &http.Transport{}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Fleet: fleet})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(eng.Close)
		return eng
	}
	a, b := engine(), engine()
	get := func(e *Engine, path string) (*http.Response, []byte) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, origin.URL+path, nil)
		resp, err := e.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		return resp, body
	}

	req, _ := http.NewRequest(http.MethodGet, origin.URL+"/big", nil)
	leader, err := a.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer leader.Body.Close()
	resp, body := get(b, "/big")
	if resp.Header.Get(HeaderCache) != CacheBypass || string(body) != string(big) {
		t.Fatalf("other instance: %s, %d bytes", resp.Header.Get(HeaderCache), len(body))
	}
	close(otherDone)
	if all, err := io.ReadAll(leader.Body); err != nil || string(all) != string(big) || leader.Header.Get(HeaderCache) != CacheMiss {
		t.Fatalf("leader: %s, %d bytes, %v", leader.Header.Get(HeaderCache), len(all), err)
	}
	if hits.Load() != 2 {
		t.Fatalf("origin requests = %d, want one per instance", hits.Load())
	}

	if resp, body := get(a, "/small"); resp.Header.Get(HeaderCache) != CacheMiss || string(body) != "small body" {
		t.Fatalf("small, leader: %s", resp.Header.Get(HeaderCache))
	}
	if resp, body := get(b, "/small"); resp.Header.Get(HeaderCache) != CacheCoalesced || string(body) != "small body" {
		t.Fatalf("small, other instance: %s", resp.Header.Get(HeaderCache))
	}
	if hits.Load() != 3 {
		t.Fatalf("origin requests = %d, want the small body once", hits.Load())
	}
}

// gatedFleet leads every Join; its leases' Finish reports the outcome on
// finished and returns only once gate is closed: a shared store that has
// not answered yet.
type gatedFleet struct {
	gate     chan struct{}
	finished chan Outcome
}

func (g *gatedFleet) Join(context.Context, string) (Lease, *Outcome, error) {
	return gatedLease{g}, nil, nil
}

type gatedLease struct{ g *gatedFleet }

func (l gatedLease) Finish(_ context.Context, out Outcome, _ time.Duration) error {
	l.g.finished <- out
	<-l.g.gate
	return nil
}

func (gatedLease) Release() {}

// TestClientsDoNotWaitForTheFleet: a flight that fetched a response to
// cache answers its clients here before the shared store has taken it
// (Finish blocks until the test lets it go). Until then the flight counts
// as in progress and a request here for the same key is answered from it,
// as a hit, without a second fetch. Once Finish returns the flight ends,
// and a request starts a new one. (A failure, or a response not to cache,
// is told to the fleet first: TestFailedFlightAcrossFleet in rediscache.)
func TestClientsDoNotWaitForTheFleet(t *testing.T) {
	var hits atomic.Int64
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		io.WriteString(w, "page")
	}))
	defer origin.Close()
	fleet := &gatedFleet{gate: make(chan struct{}), finished: make(chan Outcome, 4)}
	opened := false
	defer func() {
		if !opened {
			close(fleet.gate)
		}
	}()
	cfg := Config{Enabled: true, TTL: time.Minute}.WithDefaults()
	store := NewMemoryStore(1 << 20)
	defer store.Close()
	eng, err := New(cfg, Options{Store: store, Next: &http.Transport{}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Fleet: fleet})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	type answer struct {
		status       int
		xcache, body string
		age          bool
		err          error
	}
	get := func(url string) answer {
		t.Helper()
		done := make(chan answer, 1)
		go func() {
			req, _ := http.NewRequest(http.MethodGet, url, nil)
			resp, err := eng.RoundTrip(req)
			if err != nil {
				done <- answer{err: err}
				return
			}
			defer resp.Body.Close()
			b, err := io.ReadAll(resp.Body)
			_, age := resp.Header["Age"]
			done <- answer{resp.StatusCode, resp.Header.Get(HeaderCache), string(b), age, err}
		}()
		select {
		case a := <-done:
			return a
		case <-time.After(testkit.Patience):
			t.Fatal("the client waited for the fleet's store")
			return answer{}
		}
	}

	if a := get(origin.URL + "/page"); a.err != nil || a.status != 200 || a.xcache != CacheMiss || a.body != "page" {
		t.Fatalf("leader: %+v", a)
	}
	if out := <-fleet.finished; out.Entry == nil || string(out.Entry.Body) != "page" {
		t.Fatalf("the fleet was told %+v, want the page", out)
	}
	if st := eng.Stats(); st.Flights != 1 || st.Sharing != 1 {
		t.Errorf("while the store has not answered: %d flights in progress, %d sharing, want 1 and 1", st.Flights, st.Sharing)
	}
	if a := get(origin.URL + "/page"); a.err != nil || a.xcache != CacheHit || a.body != "page" || !a.age {
		t.Fatalf("the same page meanwhile: %+v, want a HIT with an Age", a)
	}
	if n := hits.Load(); n != 1 {
		t.Fatalf("origin saw %d requests, want 1", n)
	}

	opened = true
	close(fleet.gate)
	testkit.Eventually(t, testkit.Patience, func() bool { st := eng.Stats(); return st.Flights == 0 && st.Sharing == 0 }, "the flights to end")
	// This fleet stores nothing: a request now is a new flight.
	if a := get(origin.URL + "/page"); a.xcache != CacheMiss || hits.Load() != 2 {
		t.Fatalf("after the flight ended: %+v, origin saw %d", a, hits.Load())
	}
	if out := <-fleet.finished; out.Entry == nil {
		t.Fatalf("the fleet was told %+v, want the page", out)
	}
}
