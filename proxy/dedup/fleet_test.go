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
