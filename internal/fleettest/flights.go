package fleettest

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// FleetStampede: 300 concurrent identical requests spread over three
// instances sharing one store reach the origin once; one client gets the
// MISS, every other is COALESCED, all with the same body.
func FleetStampede(t *testing.T, newFleet Factory) {
	const n = 300
	var f *Fleet
	f = newFleet(t, Options{Instances: 3}, func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(200 * time.Millisecond)
		// An origin handler: testkit.Wait reports instead of failing here.
		testkit.Wait(t, testkit.Patience, func() bool { return f.EveryoneWaiting(n) }, "every client waiting")
		fmt.Fprintf(w, "one answer %d", time.Now().UnixNano())
	})
	res := make(chan Got, n)
	for i := range n {
		inst := f.Insts[i%3]
		go func() { res <- inst.Get(f.Origin.URL + "/stampede") }()
	}
	counts := map[string]int{}
	var body string
	for range n {
		g := <-res
		if g.Err != nil || g.Status != 200 {
			t.Fatalf("client got %+v", g)
		}
		if body == "" {
			body = g.Body
		} else if g.Body != body {
			t.Fatalf("different bodies: %q vs %q", g.Body, body)
		}
		counts[g.XCache]++
	}
	if f.Hits() != 1 {
		t.Fatalf("origin saw %d requests, want 1", f.Hits())
	}
	if counts[dedup.CacheMiss] != 1 || counts[dedup.CacheCoalesced] != n-1 {
		t.Fatalf("X-Cache counts %v", counts)
	}
}

// HitOnAnotherInstance: a page fetched through A is a HIT on B and C,
// with the same body (compressible, so a store that compresses values
// does).
func HitOnAnotherInstance(t *testing.T, newFleet Factory) {
	f := newFleet(t, Options{Instances: 3}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		fmt.Fprintf(w, "<p>%s</p>%s", r.URL.Path, make([]byte, 4096))
	})
	a := f.Insts[0].Get(f.Origin.URL + "/shared")
	if a.XCache != dedup.CacheMiss {
		t.Fatalf("A: %+v", a)
	}
	for _, inst := range f.Insts[1:] {
		if g := inst.Get(f.Origin.URL + "/shared"); g.XCache != dedup.CacheHit || g.Body != a.Body {
			t.Fatalf("%s: %s, body equal %v", inst.Name, g.XCache, g.Body == a.Body)
		}
	}
	if f.Hits() != 1 {
		t.Fatalf("origin hits %d", f.Hits())
	}
}

// FailedFlightAcrossFleet: a 500 reaches the waiters of that flight on
// every instance; nothing is cached; the next request gets a fresh flight.
func FailedFlightAcrossFleet(t *testing.T, newFleet Factory) {
	var calls atomic.Int64
	var f *Fleet
	const n = 6
	f = newFleet(t, Options{Instances: 2}, func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			testkit.Wait(t, testkit.Patience, func() bool { return f.EveryoneWaiting(n) }, "the waiters")
			http.Error(w, "origin broke", http.StatusInternalServerError)
			return
		}
		io.WriteString(w, "recovered")
	})
	res := make(chan Got, n)
	for i := range n {
		inst := f.Insts[i%2]
		go func() { res <- inst.Get(f.Origin.URL + "/flaky") }()
	}
	for range n {
		if g := <-res; g.Status != 500 {
			t.Fatalf("waiter: %+v", g)
		}
	}
	if f.Hits() != 1 {
		t.Fatalf("failed flight stampeded: %d origin hits", f.Hits())
	}
	if g := f.Insts[1].Get(f.Origin.URL + "/flaky"); g.Status != 200 || g.Body != "recovered" {
		t.Fatalf("next request: %+v", g)
	}
}

// ConnectionErrorSharedAcrossFleet: a transport failure (an origin that
// is gone) reaches the client as an error, never as a cached answer.
func ConnectionErrorSharedAcrossFleet(t *testing.T, newFleet Factory) {
	f := newFleet(t, Options{Instances: 2}, func(w http.ResponseWriter, r *http.Request) {})
	dead := f.Origin.URL
	f.Origin.Close()
	if g := f.Insts[0].Get(dead + "/x"); g.Err == nil {
		t.Fatalf("got %+v", g)
	}
}

// InvalidationReachesTheFleet: invalidating on A drops B's local copy (a
// long local_ttl, so only the invalidation can), by URL and by key.
func InvalidationReachesTheFleet(t *testing.T, newFleet Factory) {
	f := newFleet(t, Options{Instances: 2, LocalTTL: time.Minute}, func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "v%d", time.Now().UnixNano())
	})
	a, b := f.Insts[0], f.Insts[1]
	u := f.Origin.URL + "/inv?x=1"
	key := a.Get(u).Key
	if g := b.Get(u); g.XCache != dedup.CacheHit {
		t.Fatalf("B: %s", g.XCache)
	}
	n, err := a.Engine.InvalidateURL(context.Background(), u)
	if err != nil || n != 1 {
		t.Fatalf("InvalidateURL = %d, %v", n, err)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return b.localDropped(key) }, "B's local tier to drop the URL")
	if g := b.Get(u); g.XCache != dedup.CacheMiss {
		t.Fatalf("after invalidation B got %s", g.XCache)
	}
	// By key too (B's fetch above stored it again).
	if g := a.Get(u); g.XCache != dedup.CacheHit {
		t.Fatalf("A: %s", g.XCache)
	}
	if err := a.Engine.InvalidateKey(context.Background(), key); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return b.localDropped(key) }, "key invalidated on B")
	if g := b.Get(u); g.XCache != dedup.CacheMiss {
		t.Fatalf("after key invalidation B got %s", g.XCache)
	}
}

// LeaderGoneTakeover: the instance leading a flight is cut off from the
// store mid-fetch, as its death would cut it (kill does that, the store's
// way); a waiter on another instance takes the flight over within the
// given time and fetches it, and every client, the dead leader's too,
// still gets an answer: the origin sees the two fetches and no more. The
// log line says how long the takeover took.
func LeaderGoneTakeover(t *testing.T, newFleet Factory, kill func(leader *Instance), within time.Duration) {
	release := make(chan struct{})
	var once sync.Once
	open := func() { once.Do(func() { close(release) }) }
	defer open() // a failure must not leave the origin's handler (and Close) waiting
	arrived := make(chan struct{}, 4)
	f := newFleet(t, Options{Instances: 2}, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/crash" {
			arrived <- struct{}{}
			<-release
		}
		io.WriteString(w, "answer")
	})
	a, b := f.Insts[0], f.Insts[1]
	resA := make(chan Got, 1)
	go func() { resA <- a.Get(f.Origin.URL + "/crash") }()
	<-arrived // A leads and is fetching
	const n = 5
	resB := make(chan Got, n)
	for range n {
		go func() { resB <- b.Get(f.Origin.URL + "/crash") }()
	}
	testkit.Eventually(t, testkit.Patience, func() bool {
		return b.Engine.Stats().Waiters == n && b.FleetWaits() == 1
	}, "B's clients waiting on A's flight")
	kill(a)
	killed := time.Now()
	select {
	case <-arrived: // B took over
	case <-time.After(within):
		t.Fatal("no instance took over the dead leader's flight")
	}
	t.Logf("leader gone: a waiter elsewhere took over its flight after %s", time.Since(killed).Round(time.Millisecond))
	open()
	for range n {
		if g := <-resB; g.Err != nil || g.Status != 200 || g.Body != "answer" {
			t.Fatalf("B client: %+v", g)
		}
	}
	if g := <-resA; g.Err != nil || g.Status != 200 {
		t.Fatalf("A client: %+v", g)
	}
	if f.Hits() != 2 {
		t.Fatalf("origin saw %d requests, want 2 (the dead leader's and the takeover)", f.Hits())
	}
}

// ConcurrentLookupsShareOneRead: a stampede of lookups on one instance
// reads a value the store holds (and the memory tier does not) with one
// read of the store, not one per client: a store slowed down sees one
// waiting read instead of a pool's worth. stall slows the store's reads
// down until resume (every lookup arrives while the first read waits);
// reads counts the store's reads since stall, and says what they were.
func ConcurrentLookupsShareOneRead(t *testing.T, newFleet Factory, stall func() (resume func()), reads func() (n int, what string)) {
	f := newFleet(t, Options{Instances: 1}, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "shared")
	})
	inst := f.Insts[0]
	key := inst.Get(f.Origin.URL + "/one").Key // MISS, stored
	ctx := context.Background()
	inst.Local.Delete(ctx, key)
	resume := stall()
	const n = 200
	var wg sync.WaitGroup
	var found atomic.Int64
	for range n {
		wg.Go(func() {
			if e, err := inst.Store.Get(ctx, key); err == nil && string(e.Body) == "shared" {
				found.Add(1)
			}
		})
	}
	time.Sleep(200 * time.Millisecond)
	resume()
	wg.Wait()
	if found.Load() != n {
		t.Fatalf("%d of %d lookups found the value", found.Load(), n)
	}
	if r, what := reads(); r != 1 {
		t.Fatalf("%d concurrent lookups made %d reads of the store, want 1:\n%s", n, r, what)
	}
}
