package upstream_test

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// memBindings is a fleet store at the Bus seam: bindings in a map, calls
// counted, notes recorded; fail makes every call fail.
type memBindings struct {
	mu    sync.Mutex
	m     map[string]string
	calls int
	fail  bool
	notes []string
	subs  map[string]func(string, time.Duration)
}

func (b *memBindings) Publish(topic, key, msg string, ttl time.Duration) {
	b.mu.Lock()
	b.notes = append(b.notes, topic+" "+msg)
	b.mu.Unlock()
}

func (b *memBindings) Subscribe(topic string, f func(string, time.Duration)) {
	b.mu.Lock()
	if b.subs == nil {
		b.subs = map[string]func(string, time.Duration){}
	}
	b.subs[topic] = f
	b.mu.Unlock()
}

func (b *memBindings) Bind(_ context.Context, key, proposal string, _ time.Duration) (string, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.calls++
	if b.fail {
		return "", errors.New("store away")
	}
	if cur, ok := b.m[key]; ok {
		return cur, nil
	}
	b.m[key] = proposal
	return proposal, nil
}

func (b *memBindings) Rebind(_ context.Context, key, from, to string, _ time.Duration) (string, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.calls++
	if b.fail {
		return "", errors.New("store away")
	}
	if cur, ok := b.m[key]; ok && cur != from {
		return cur, nil
	}
	b.m[key] = to
	return to, nil
}

func (b *memBindings) state() (calls int, m map[string]string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	c := map[string]string{}
	for k, v := range b.m {
		c[k] = v
	}
	return b.calls, c
}

// TestFleetBindingsCostAndUntrustedValues: a sticky request asks the
// store once, then not again while its session serves (the local copy);
// requests without a sticky key never ask. A binding that names no
// session here (unknown, or not an id) is ignored, counted and moved; a
// store that fails leaves each instance to choose alone; garbage notes are
// counted and change nothing.
func TestFleetBindingsCostAndUntrustedValues(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 3})
	o := newOrigin(t, false)
	logger, _ := testLogger(t)
	store := &memBindings{m: map[string]string{}}
	cfg := upstream.Config{Sessions: []upstream.SessionConfig{
		{ID: "a", URL: fp.URL("s1", "http")}, {ID: "b", URL: fp.URL("s2", "http")}, {ID: "c", URL: fp.URL("s3", "http")},
	}}
	p, err := upstream.New(cfg, logger, upstream.WithBus(store))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)

	for i := range 10 {
		mustGet(t, p, o.URL, clientinfo.Info{Key: string(rune('a' + i))})
	}
	if calls, _ := store.state(); calls != 0 {
		t.Fatalf("requests without a sticky key made %d store calls", calls)
	}
	first := mustGet(t, p, o.URL, clientinfo.Info{Account: "acct", Session: "crawl"})
	for range 10 {
		if r := mustGet(t, p, o.URL, clientinfo.Info{Account: "acct", Session: "crawl"}); r.upstream != first.upstream {
			t.Fatalf("sticky key moved from %s to %s", first.upstream, r.upstream)
		}
	}
	if calls, m := store.state(); calls != 1 || len(m) != 1 {
		t.Fatalf("11 sticky requests: %d store calls, bindings %v; want 1 call", calls, m)
	}

	// A key bound in the store to things that are not sessions here: a
	// fresh pool each time (the one before remembers where it moved it).
	store.mu.Lock()
	store.m = map[string]string{}
	store.mu.Unlock()
	mustGet(t, p, o.URL, clientinfo.Info{Account: "acct2", Session: "k"})
	_, m := store.state()
	var k2 string
	for k := range m {
		k2 = k
	}
	for _, bogus := range []string{"ghost", "not an id!"} {
		store.mu.Lock()
		store.m[k2] = bogus
		store.mu.Unlock()
		p2, err := upstream.New(cfg, logger, upstream.WithBus(store))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p2.Close)
		r := mustGet(t, p2, o.URL, clientinfo.Info{Account: "acct2", Session: "k"})
		if r.status != 200 || r.upstream == bogus {
			t.Fatalf("binding to %q: %+v", bogus, r)
		}
		if _, m := store.state(); m[k2] != r.upstream {
			t.Fatalf("binding to %q not moved to %s: %v", bogus, r.upstream, m[k2])
		}
		if st := p2.BindingStats(); st.Rejected != 1 || st.Moves != 1 {
			t.Fatalf("binding to %q: %+v", bogus, st)
		}
	}

	// The store away: the pool chooses alone, the same way.
	store.mu.Lock()
	store.fail = true
	store.mu.Unlock()
	p3, _ := upstream.New(cfg, logger, upstream.WithBus(store))
	t.Cleanup(p3.Close)
	if r := mustGet(t, p3, o.URL, clientinfo.Info{Account: "acct", Session: "crawl"}); r.status != 200 || r.upstream != first.upstream {
		t.Fatalf("store away: %+v, want %s (the same hash)", r, first.upstream)
	}
	if st := p3.BindingStats(); st.Errors != 1 {
		t.Fatalf("store away: %+v", st)
	}

	// Garbage "binding" notes are counted, nothing else.
	store.mu.Lock()
	hear := store.subs["binding"]
	store.mu.Unlock()
	n := p3.NotesRejected()
	for _, note := range []string{"", "{", `{"key":"zz","session":"a"}`, `{"key":"12","session":"a b"}`, `{"key":"0","session":"a"}`} {
		hear(note, 0)
	}
	if p3.NotesRejected() != n+5 {
		t.Fatalf("garbage binding notes: %d rejected, want 5", p3.NotesRejected()-n)
	}
}

// TestFleetStickyKeyKeepsItsSessionAfterARetry: a sticky request retried
// on another session because its own failed it without a cooldown (an
// origin's 500) goes to the other session for that attempt only; the key
// stays bound, fleet-wide as alone, and the next request goes back. With a
// fleet store the retry used to rebind the key for good: one 500 moved a
// sticky client to another exit IP.
func TestFleetStickyKeyKeepsItsSessionAfterARetry(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 3})
	o := newOrigin(t, false)
	var fail atomic.Bool
	o.setBehave(func(_ string, w http.ResponseWriter, r *http.Request) bool {
		if fail.CompareAndSwap(true, false) {
			http.Error(w, "oops", http.StatusInternalServerError)
			return true
		}
		return false
	})
	cfg := upstream.Config{Sessions: []upstream.SessionConfig{
		{ID: "a", URL: fp.URL("s1", "http")}, {ID: "b", URL: fp.URL("s2", "http")}, {ID: "c", URL: fp.URL("s3", "http")}}}
	aloneAndFleet(t, cfg, func(t *testing.T, p *upstream.Pool) {
		info := clientinfo.Info{Account: "acct", Session: "crawl"}
		first := mustGet(t, p, o.URL, info)
		fail.Store(true)
		if r := mustGet(t, p, o.URL, info); r.status != http.StatusOK || r.upstream == first.upstream {
			t.Fatalf("the retried request: %+v; want a 200 through another session than %s", r, first.upstream)
		}
		if after := mustGet(t, p, o.URL, info); after.upstream != first.upstream {
			t.Errorf("after one retry the sticky key moved from %s to %s", first.upstream, after.upstream)
		}
	})
}

// aloneAndFleet runs f on a pool over cfg alone, then on one whose fleet
// store is a memBindings.
func aloneAndFleet(t *testing.T, cfg upstream.Config, f func(t *testing.T, p *upstream.Pool)) {
	logger, _ := testLogger(t)
	for _, fleet := range []bool{false, true} {
		t.Run(map[bool]string{false: "alone", true: "fleet"}[fleet], func(t *testing.T) {
			var opts []upstream.Option
			if fleet {
				opts = append(opts, upstream.WithBus(&memBindings{m: map[string]string{}}))
			}
			p, err := upstream.New(cfg, logger, opts...)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(p.Close)
			f(t, p)
		})
	}
}
