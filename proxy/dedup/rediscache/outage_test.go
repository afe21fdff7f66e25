package rediscache

import (
	"context"
	"crypto/rand"
	"fmt"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fleettest"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestOutageKeepsSavings: Redis killed and restarted (empty) under steady
// load over hot keys on two instances. Each instance's memory tier is the
// cache meanwhile, for the full TTL, and after the restart gives its copies
// back instead of fetching them again: every key reaches the origin at
// most once per instance over a run shorter than the TTL, and no client
// request fails. With LONG_TESTS set (CI), the outage lasts 20 s over 50
// hot keys.
func TestOutageKeepsSavings(t *testing.T) {
	keys, outage := 8, 800*time.Millisecond
	if os.Getenv("LONG_TESTS") != "" {
		keys, outage = 50, 20*time.Second
	}
	var mu sync.Mutex
	hits := map[string]int{} // "instance path" → origin requests
	f := newFleet(t, 2, Config{
		LocalTTL:        100 * time.Millisecond,
		BreakerInterval: 300 * time.Millisecond,
		BreakerFailures: 2,
		PollInterval:    20 * time.Millisecond,
	}, dedup.Config{TTL: time.Minute}, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		hits[r.Header.Get(instanceHeader)+" "+r.URL.Path]++
		mu.Unlock()
		time.Sleep(5 * time.Millisecond)
		fmt.Fprintf(w, "page %s", r.URL.Path)
	})
	stop := fleettest.Load(4, func(w, i int) fleettest.Got {
		g := fleettest.Get(f.insts[(w+i)%2].engine, fmt.Sprintf("%s/hot/%d", f.origin.URL, i%keys))
		time.Sleep(2 * time.Millisecond)
		return g
	})
	time.Sleep(400 * time.Millisecond)
	f.redis.Kill()
	testkit.Eventually(t, testkit.Patience, func() bool { return !f.insts[0].be.Available() && !f.insts[1].be.Available() }, "both breakers open")
	time.Sleep(outage) // load on the memory tiers alone
	f.redis.Restart()
	testkit.Eventually(t, testkit.Patience, func() bool { return f.insts[0].be.Available() && f.insts[1].be.Available() }, "both instances back on Redis")
	time.Sleep(600 * time.Millisecond) // several local_ttl: copies are asked of Redis again
	counts, errs := stop()

	t.Logf("X-Cache: %v; origin requests per instance and key: %v", counts, hits)
	if len(errs) > 0 {
		t.Fatalf("%d client requests failed, first: %s", len(errs), errs[0])
	}
	for k, n := range hits {
		if n > 1 {
			t.Errorf("%s reached the origin %d times in less than a TTL", k, n)
		}
	}
	// Redis has the hot keys again: given back, not fetched again.
	rc := f.redis.Client()
	vals, err := rc.Keys(context.Background(), f.insts[0].store.prefix+"{*}:v").Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(vals) != keys {
		t.Errorf("after the restart Redis holds %d values, want the %d hot keys", len(vals), keys)
	}
}

// TestOutageCopyGivenBack: a page fetched while Redis was down is given
// back to Redis once it returns (the next request for it is a HIT, and a
// HIT on the other instance); a value Redis has wins over a copy cached
// during the outage.
func TestOutageCopyGivenBack(t *testing.T) {
	var n atomic.Int64
	f := newFleet(t, 2, Config{LocalTTL: 50 * time.Millisecond, BreakerInterval: 200 * time.Millisecond, BreakerFailures: 1},
		dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprintf(w, "%s %s #%d", r.URL.Path, r.Header.Get(instanceHeader), n.Add(1))
		})
	a, b := f.insts[0], f.insts[1]
	f.redis.Kill()
	testkit.Eventually(t, testkit.Patience, func() bool {
		_ = a.be.c.beat(context.Background())
		_ = b.be.c.beat(context.Background())
		return !a.be.Available() && !b.be.Available()
	}, "the breakers open")
	kept := a.get(f.origin.URL + "/kept")  // A alone
	mine := a.get(f.origin.URL + "/mine")  // A alone
	other := b.get(f.origin.URL + "/mine") // B alone, another copy
	for _, g := range []got{kept, mine, other} {
		if g.status != 200 || g.xcache != dedup.CacheBypass {
			t.Fatalf("during the outage: %+v, want 200 BYPASS", g)
		}
	}
	if g := a.get(f.origin.URL + "/kept"); g.xcache != dedup.CacheHit || g.body != kept.body {
		t.Fatalf("during the outage, again: %+v", g)
	}
	f.redis.Restart()
	testkit.Eventually(t, testkit.Patience, func() bool { return a.be.Available() && b.be.Available() }, "Redis back")
	// B asks first for /mine: Redis has none, B gives its copy back.
	time.Sleep(100 * time.Millisecond)
	if g := b.get(f.origin.URL + "/mine"); g.xcache != dedup.CacheHit || g.body != other.body {
		t.Fatalf("B after the outage: %+v, want HIT %q", g, other.body)
	}
	// A's copy of /mine is older news than Redis's value: Redis wins.
	if g := a.get(f.origin.URL + "/mine"); g.xcache != dedup.CacheHit || g.body != other.body {
		t.Fatalf("A after the outage: %+v, want the fleet's value %q", g, other.body)
	}
	// A's /kept reaches Redis and B.
	if g := a.get(f.origin.URL + "/kept"); g.xcache != dedup.CacheHit || g.body != kept.body {
		t.Fatalf("A /kept after the outage: %+v", g)
	}
	if g := b.get(f.origin.URL + "/kept"); g.xcache != dedup.CacheHit || g.body != kept.body {
		t.Fatalf("B /kept after the outage: %+v, want A's %q", g, kept.body)
	}
	if n.Load() != 3 {
		t.Fatalf("origin saw %d requests, want 3 (the outage's)", n.Load())
	}
}

// TestIdleInstanceSeesOutage: without any traffic, the heartbeat tells an
// instance that Redis went away and that it came back.
func TestIdleInstanceSeesOutage(t *testing.T) {
	fleettest.IdleInstanceFollowsTheStore(t, contract(Config{BreakerInterval: 300 * time.Millisecond, PresenceTTL: 750 * time.Millisecond}, nil))
}

// TestValueOverMaxValueBytes: a response too big for Redis after
// compression (random bytes) is cached by the instance that fetched it
// only, for its full TTL; the clients waiting for it on another instance
// get it once, through the flight's outcome; later requests on that
// instance fetch their own. Nothing of it stays in Redis.
func TestValueOverMaxValueBytes(t *testing.T) {
	body := make([]byte, 100<<10) // over max_value_bytes and inlineOutcomeBytes
	rand.Read(body)
	release := make(chan struct{})
	var n atomic.Int64
	f := newFleet(t, 2, Config{MaxValueBytes: 4 << 10, LocalTTL: 50 * time.Millisecond}, dedup.Config{},
		func(w http.ResponseWriter, r *http.Request) {
			n.Add(1)
			if r.URL.Path == "/big" {
				<-release
			}
			w.Header().Set("Content-Type", "application/octet-stream")
			w.Write(body)
		})
	a, b := f.insts[0], f.insts[1]
	resA := make(chan got, 1)
	go func() { resA <- a.get(f.origin.URL + "/big") }()
	testkit.Eventually(t, testkit.Patience, func() bool { return n.Load() == 1 }, "A fetching")
	const waiters = 3
	resB := make(chan got, waiters)
	for range waiters {
		go func() { resB <- b.get(f.origin.URL + "/big") }()
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return b.store.fleetWaits.Load() == 1 && b.engine.Stats().Waiters == waiters }, "B waiting on A's flight")
	close(release)
	ga := <-resA
	if ga.xcache != dedup.CacheMiss || ga.body != string(body) {
		t.Fatalf("A: %s, %d bytes", ga.xcache, len(ga.body))
	}
	for range waiters {
		if g := <-resB; g.xcache != dedup.CacheCoalesced || g.body != string(body) {
			t.Fatalf("B waiter: %s %v, %d bytes", g.xcache, g.err, len(g.body))
		}
	}
	rc := f.redis.Client()
	ctx := context.Background()
	tag := tagOf(ga.key)
	if v, _ := rc.Exists(ctx, a.store.valueKey(tag)).Result(); v != 0 {
		t.Error("the oversized value was stored in Redis")
	}
	time.Sleep(100 * time.Millisecond) // past local_ttl
	if g := a.get(f.origin.URL + "/big"); g.xcache != dedup.CacheHit || g.body != string(body) {
		t.Errorf("A again: %s (want a HIT from its memory)", g.xcache)
	}
	if g := b.get(f.origin.URL + "/big"); g.xcache != dedup.CacheMiss || g.body != string(body) {
		t.Errorf("B again: %s (want its own fetch)", g.xcache)
	}
	if n.Load() != 2 {
		t.Errorf("origin saw %d requests, want 2 (A's flight, B's own later)", n.Load())
	}
	// With nobody waiting, the outcome is not even sent.
	lone := a.get(f.origin.URL + "/lone")
	if lone.xcache != dedup.CacheMiss {
		t.Fatalf("lone: %+v", lone)
	}
	for _, k := range []string{a.store.valueKey(tagOf(lone.key)), a.store.outcomeKey(tagOf(lone.key))} {
		if v, _ := rc.Exists(ctx, k).Result(); v != 0 {
			t.Errorf("%s kept in Redis", k)
		}
	}
}
