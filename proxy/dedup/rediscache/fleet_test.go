package rediscache

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/seed-a3c387e8/onceproxy/internal/fleettest"
	"github.com/seed-a3c387e8/onceproxy/internal/logbuf"
	"github.com/seed-a3c387e8/onceproxy/internal/redistest"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/storecodec"
)

// instance is one onceproxy process as far as dedup goes: its own memory
// tier, Redis client, engine and events loop.
type instance struct {
	name   string
	be     *Backend
	store  *Cache
	bus    *Bus
	engine *dedup.Engine
	peer   *fleettest.PeerListener // nil without peers
	stop   func()
}

type fleetFixture struct {
	t      *testing.T
	redis  *redistest.Server
	origin *httptest.Server
	hits   atomic.Int64
	insts  []*instance
	logs   *logbuf.Buffer
	// peers: instances started from now on serve bodies too big for
	// Redis on a peer listener and read them from each other's.
	peers bool
}

// newFleet starts n instances sharing one private redis-server, all in
// front of one origin served by h.
func newFleet(t *testing.T, n int, rc Config, dc dedup.Config, h http.HandlerFunc) *fleetFixture {
	t.Helper()
	return startFleet(t, &fleetFixture{}, n, rc, dc, h)
}

// startFleet is newFleet for a fixture whose options are set already.
func startFleet(t *testing.T, f *fleetFixture, n int, rc Config, dc dedup.Config, h http.HandlerFunc) *fleetFixture {
	t.Helper()
	f.t, f.redis, f.logs = t, redistest.Start(t), fleettest.Logs(t)
	f.origin = fleettest.Origin(t, &f.hits, h)
	for i := range n {
		f.insts = append(f.insts, f.start(fmt.Sprintf("i%d", i), rc, dc))
	}
	return f
}

func (f *fleetFixture) start(name string, rc Config, dc dedup.Config) *instance {
	t := f.t
	logger := fleettest.Logger(f.logs, name)
	if len(rc.Addrs) == 0 && rc.URL == "" {
		rc.URL = f.redis.URL
	}
	if rc.BreakerInterval == 0 {
		rc.BreakerInterval = 500 * time.Millisecond
	}
	dc = fleettest.EngineConfig(dc)
	local := dedup.NewMemoryStore(int64(dc.Memory.MaxBytes))
	be, err := Open(rc, local, logger)
	if err != nil {
		t.Fatal(err)
	}
	st := be.Cache
	tr := &http.Transport{}
	var advertise func(string)
	if f.peers {
		advertise = st.AdvertisePeer
	}
	opts := dedup.Options{Store: st, Fleet: st, Recorder: be.Bus, Next: fromInstance{tr, name}, Logger: logger}
	eng, peer, stop := fleettest.Serve(t, dc, opts, advertise, be.Run, be.Close, local.Close, tr.CloseIdleConnections)
	return &instance{name: name, be: be, store: st, bus: be.Bus, engine: eng, peer: peer, stop: stop}
}

// fromInstance names the instance whose request reaches the origin, in
// the header instanceHeader.
type fromInstance struct {
	next http.RoundTripper
	name string
}

const instanceHeader = "X-Test-Instance"

func (f fromInstance) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set(instanceHeader, f.name)
	return f.next.RoundTrip(r)
}

type got struct {
	status int
	xcache string
	key    string
	body   string
	err    error
}

// get sends a request through i, and returns once i's flights have
// handed what they fetched to the fleet's store (fleettest.Get).
func (i *instance) get(url string) got { return gotFrom(fleettest.Get(i.engine, url)) }

// getNow is get without the wait for the store.
func (i *instance) getNow(url string) got { return gotFrom(fleettest.GetNow(i.engine, url)) }

// gotFrom is fleettest's Got under the short names this package's tests
// use.
func gotFrom(g fleettest.Got) got { return got{g.Status, g.XCache, g.Key, g.Body, g.Err} }

// settle waits until every instance's flights have handed what they
// fetched to the fleet's store (see get).
func (f *fleetFixture) settle(t testing.TB) {
	t.Helper()
	testkit.Eventually(t, testkit.Patience, func() bool {
		for _, i := range f.insts {
			if i.engine.Stats().Sharing != 0 {
				return false
			}
		}
		return true
	}, "the flights to hand their values to the store")
}

// everyoneWaiting: n clients wait, and every instance but the leader's
// waits on the leader's flight.
func (f *fleetFixture) everyoneWaiting(n int64) bool { return f.contractFleet().EveryoneWaiting(n) }

// fleetWaiting counts the instances whose flight waits on another
// instance's.
func (f *fleetFixture) fleetWaiting() int64 { return f.contractFleet().FleetWaiting() }

// TestFleetStampede: 300 concurrent identical requests spread over three
// instances sharing one Redis reach the origin once.
func TestFleetStampede(t *testing.T) { fleettest.FleetStampede(t, contract(Config{}, nil)) }

// TestHitOnAnotherInstance: a page fetched through A is a HIT on B and C.
func TestHitOnAnotherInstance(t *testing.T) {
	fleettest.HitOnAnotherInstance(t, contract(Config{}, nil))
}

// TestLeaderCrashTakeover: the leading instance loses Redis mid-flight (as
// if killed): its presence key lapses, a waiter on another instance takes
// over well before the lease would have lapsed, and every client still gets
// an answer.
func TestLeaderCrashTakeover(t *testing.T) {
	var f *fleetFixture
	rc := Config{}.WithDefaults() // production lease and presence_ttl
	fleettest.LeaderGoneTakeover(t, contract(rc, &f), func(*fleettest.Instance) {
		// "Kill" A as far as the fleet can tell: its Redis connections
		// die, so it neither beats, nor renews its lease, nor publishes
		// an outcome.
		f.insts[0].store.rdb.Close()
	}, rc.Lease+5*time.Second)
	t.Logf("presence_ttl %s, lease %s, poll %s", rc.PresenceTTL, rc.Lease, rc.PollInterval)
}

// TestFailedFlightAcrossFleet: a 500 reaches the waiters of that flight on
// every instance; nothing is cached; the next request gets a fresh flight.
func TestFailedFlightAcrossFleet(t *testing.T) {
	fleettest.FailedFlightAcrossFleet(t, contract(Config{}, nil))
}

// TestConnectionErrorSharedAcrossFleet: a transport failure is shared too.
func TestConnectionErrorSharedAcrossFleet(t *testing.T) {
	f := newFleet(t, 2, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {})
	dead := f.origin.URL
	f.origin.Close()
	if g := f.insts[0].get(dead + "/x"); g.err == nil {
		t.Fatalf("got %+v", g)
	}
}

// TestInvalidationReachesTheFleet: invalidating on A drops B's local copy,
// by URL and by key.
func TestInvalidationReachesTheFleet(t *testing.T) {
	fleettest.InvalidationReachesTheFleet(t, contract(Config{}, nil))
}

func TestInvalidationReachesEveryDiskTier(t *testing.T) {
	fleettest.InvalidationReachesEveryDiskTier(t, contract(Config{}, nil))
}

func TestInvalidationDuringAFleetFlight(t *testing.T) {
	fleettest.InvalidationDuringAFleetFlight(t, contract(Config{}, nil))
}

// TestOlderFormatIsIgnored: a value in another format version is a miss
// and gets replaced, never misread.
func TestOlderFormatIsIgnored(t *testing.T) {
	f := newFleet(t, 1, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "fresh")
	})
	inst := f.insts[0]
	u := f.origin.URL + "/old"
	key := inst.get(u).key // MISS, stored
	inst.store.local.Delete(context.Background(), key)
	old := storecodec.Encode(&dedup.Entry{Status: 200, Body: []byte("stale v0"), ExpiresAt: time.Now().Add(time.Hour)})
	old[len("ONCE")] = 0 // an older format version (after the magic)
	rc := f.redis.Client()
	if err := rc.Set(context.Background(), inst.store.valueKey(tagOf(key)), old, time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	if g := inst.get(u); g.body != "fresh" || g.xcache != dedup.CacheMiss {
		t.Fatalf("old value misread: %+v", g)
	}
	if g := inst.get(u); g.body != "fresh" || g.xcache != dedup.CacheHit {
		t.Fatalf("replacement not stored: %+v", g)
	}
}

// TestRedisOutageDuringLoad: Redis killed under steady load costs savings,
// never requests; after a restart shared HITs resume within the breaker
// interval; nothing leaks.
func TestRedisOutageDuringLoad(t *testing.T) {
	fleettest.OutageDuringLoad(t, contract(Config{}, nil))
}

// TestRedisDownAtStart: the proxy starts and serves without Redis, then
// joins the fleet when Redis appears.
func TestRedisDownAtStart(t *testing.T) {
	srv := redistest.Start(t)
	srv.Kill()
	local := dedup.NewMemoryStore(1 << 20)
	defer local.Close()
	be, err := Open(Config{URL: srv.URL, BreakerInterval: 200 * time.Millisecond}, local, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatalf("New with Redis down: %v", err)
	}
	defer be.Close()
	st := be.Cache
	for range 5 {
		if _, _, err := st.Join(context.Background(), "v1:ab"); err == nil {
			t.Fatal("Join succeeded without Redis")
		}
	}
	if be.Available() {
		t.Fatal("breaker still closed after repeated failures")
	}
	srv.Restart()
	testkit.Eventually(t, testkit.Patience, func() bool {
		lease, _, err := st.Join(context.Background(), "v1:cd")
		if lease != nil {
			lease.Release()
		}
		return err == nil
	}, "recovery")
}

// TestFleetStatsAddUp: per-day counters in Redis sum every instance.
func TestFleetStatsAddUp(t *testing.T) { fleettest.FleetStatsAddUp(t, contract(Config{}, nil)) }

// TestConcurrentLookupsShareOneGet: a stampede on one instance reads a
// cached value with one Redis GET, not one per client; a Redis slowed
// down (here: paused) sees one waiting command instead of a pool's worth.
func TestConcurrentLookupsShareOneGet(t *testing.T) {
	var f *fleetFixture
	ctx := context.Background()
	stall := func() func() {
		rc := f.redis.Client()
		if err := rc.ConfigResetStat(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		// Redis resumes by itself.
		if err := rc.Do(ctx, "CLIENT", "PAUSE", 400, "ALL").Err(); err != nil {
			t.Fatal(err)
		}
		return func() {}
	}
	gets := func() (int, string) {
		info, err := f.redis.Client().Info(ctx, "commandstats").Result()
		if err != nil {
			t.Fatal(err)
		}
		calls := -1
		for line := range strings.Lines(info) {
			if rest, ok := strings.CutPrefix(line, "cmdstat_get:calls="); ok {
				calls, _ = strconv.Atoi(rest[:strings.IndexByte(rest, ',')])
			}
		}
		return calls, info
	}
	fleettest.ConcurrentLookupsShareOneRead(t, contract(Config{Timeout: 2 * time.Second, Lease: 6 * time.Second}, &f), stall, gets)
}

// TestNotesReachTheOtherInstances: a note published by one instance
// reaches the others' handler for its topic, never its own.
func TestNotesReachTheOtherInstances(t *testing.T) {
	fleettest.NotesReachTheOtherInstances(t, contract(Config{}, nil))
}

// TestClaimIsExclusiveAcrossInstances: one instance at a time holds a
// claim; releasing it lets the next in; it lapses by itself; with Redis
// gone every caller may proceed (one failure opens the breaker, so that
// claim does not wait out a timeout).
func TestClaimIsExclusiveAcrossInstances(t *testing.T) {
	fleettest.ClaimIsExclusiveAcrossInstances(t, contract(Config{BreakerFailures: 1}, nil))
}

// TestLastingNotesAreRecalled: a lasting note is kept until it expires,
// in the Redis's clock, and handed to instances that subscribe later.
func TestLastingNotesAreRecalled(t *testing.T) {
	fleettest.LastingNotesAreRecalled(t, contract(Config{}, nil))
}

// TestOnReconnectAfterOutage: the functions registered with onReconnect
// (the bus's recall of lasting notes) run once Redis is back after the
// breaker opened, and not before.
func TestOnReconnectAfterOutage(t *testing.T) {
	f := newFleet(t, 1, Config{BreakerFailures: 1, BreakerInterval: 100 * time.Millisecond}, dedup.Config{},
		func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "page") })
	inst := f.insts[0]
	var calls atomic.Int64
	inst.be.c.onReconnect(func() { calls.Add(1) })
	f.redis.Kill()
	testkit.Eventually(t, testkit.Patience, func() bool {
		inst.get(fmt.Sprintf("%s/down/%d", f.origin.URL, time.Now().UnixNano()))
		return !inst.be.Available()
	}, "the breaker to open")
	if calls.Load() != 0 {
		t.Fatal("OnReconnect ran while Redis was down")
	}
	f.redis.Restart()
	testkit.Eventually(t, testkit.Patience, func() bool {
		inst.get(fmt.Sprintf("%s/up/%d", f.origin.URL, time.Now().UnixNano()))
		return calls.Load() == 1
	}, "OnReconnect to run")
}

// TestLongFetchKeepsItsLease: a fetch that takes several leases keeps its
// lock (renewed in the background, by its hash and, after Redis lost its
// scripts, whole): a second instance asking meanwhile waits for it rather
// than fetching again, and gets its answer.
func TestLongFetchKeepsItsLease(t *testing.T) {
	release := make(chan struct{})
	f := newFleet(t, 2, Config{Timeout: 100 * time.Millisecond, Lease: 300 * time.Millisecond}, dedup.Config{FlightTimeout: 30 * time.Second}, func(w http.ResponseWriter, r *http.Request) {
		<-release
		io.WriteString(w, "slow")
	})
	var once sync.Once
	let := func() { once.Do(func() { close(release) }) }
	t.Cleanup(let) // before the origin closes: a failed test must not hang it
	a, b := f.insts[0], f.insts[1]
	first := make(chan got, 1)
	go func() { first <- a.get(f.origin.URL + "/long") }()
	testkit.Eventually(t, 10*time.Second, func() bool { return f.hits.Load() == 1 }, "the fetch reaching the origin")

	// Four leases in, with the scripts flushed half-way.
	time.Sleep(600 * time.Millisecond)
	if err := f.redis.Client().ScriptFlush(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(600 * time.Millisecond)
	second := make(chan got, 1)
	go func() { second <- b.get(f.origin.URL + "/long") }()
	testkit.Eventually(t, 10*time.Second, func() bool { return f.fleetWaiting() == 1 }, "the second instance waiting on the first")
	time.Sleep(600 * time.Millisecond) // the waiter polls, and must keep waiting
	let()

	for _, ch := range []chan got{first, second} {
		g := <-ch
		if g.err != nil || g.body != "slow" {
			t.Fatalf("got %+v", g)
		}
	}
	if n := f.hits.Load(); n != 1 {
		t.Fatalf("the origin was asked %d times; a renewed lease keeps it at 1", n)
	}
}

// TestClusterFleet runs two instances on a real three-master Redis
// Cluster: a flight's keys share one slot (its hash tag) and the URL index
// lives in the URL's slot, so a stampede across both instances reaches the
// origin once, the other instance hits, and invalidation by URL reaches
// both, with no CROSSSLOT error on the way.
func TestClusterFleet(t *testing.T) {
	addrs := redistest.StartCluster(t, 3)
	const n = 40
	var f *fleetFixture
	f = newFleet(t, 2, Config{Addrs: addrs, LocalTTL: time.Minute}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/stampede" {
			testkit.Wait(t, testkit.Patience, func() bool { return f.everyoneWaiting(n) }, "every client waiting")
		}
		fmt.Fprintf(w, "v%d", time.Now().UnixNano())
	})
	a, b := f.insts[0], f.insts[1]
	res := make(chan got, n)
	for i := range n {
		inst := f.insts[i%2]
		go func() { res <- inst.get(f.origin.URL + "/stampede") }()
	}
	counts := map[string]int{}
	for range n {
		g := <-res
		if g.err != nil || g.status != 200 {
			t.Fatalf("client got %+v", g)
		}
		counts[g.xcache]++
	}
	if f.hits.Load() != 1 || counts[dedup.CacheMiss] != 1 || counts[dedup.CacheCoalesced] != n-1 {
		t.Fatalf("origin saw %d, X-Cache %v: want 1 and 1 MISS, %d COALESCED", f.hits.Load(), counts, n-1)
	}

	// Many URLs, so their keys and indexes land on every master.
	for i := range 30 {
		u := fmt.Sprintf("%s/page/%d", f.origin.URL, i)
		if g := a.get(u); g.xcache != dedup.CacheMiss {
			t.Fatalf("A %s: %+v", u, g)
		}
		if g := b.get(u); g.xcache != dedup.CacheHit {
			t.Fatalf("B %s: %+v", u, g)
		}
	}
	u := f.origin.URL + "/page/7"
	key := a.get(u).key
	if got, err := a.engine.InvalidateURL(context.Background(), u); err != nil || got != 1 {
		t.Fatalf("InvalidateURL = %d, %v", got, err)
	}
	testkit.Eventually(t, testkit.Patience, func() bool {
		_, err := b.store.local.Get(context.Background(), key)
		return err != nil
	}, "B's local tier to drop the URL")
	if g := b.get(u); g.xcache != dedup.CacheMiss {
		t.Fatalf("after invalidation B got %+v", g)
	}
	if strings.Contains(f.logs.String(), "CROSSSLOT") {
		t.Fatal("a command crossed slots (the fleet's log follows)")
	}
	for _, addr := range addrs {
		c := redis.NewClient(&redis.Options{Addr: addr})
		n, err := c.DBSize(context.Background()).Result()
		c.Close()
		if err != nil || n == 0 {
			t.Errorf("master %s holds %d keys (%v): the test did not spread over the cluster", addr, n, err)
		}
	}
}

// TestLeaderAnswersBeforeRedisStores: the leader's answer, a small body
// read whole or a bigger one streamed through a spool (with or without a
// Content-Length), reaches its client while Redis still refuses writes
// (CLIENT PAUSE WRITE from the origin's handler, after the lease was
// taken): the flight stays in progress, and a request on the same
// instance meanwhile is a HIT from it, with no second fetch. Once Redis
// takes writes again the value reaches the fleet: a HIT on the other
// instance.
func TestLeaderAnswersBeforeRedisStores(t *testing.T) {
	big := strings.Repeat("0123456789abcdef", 200<<10/16) // past the 64 KiB read whole
	for _, tc := range []struct {
		name, body string
		length     bool
	}{
		{"small", "page", true},
		{"spooled", big, true},
		{"spooled-chunked", big, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var f *fleetFixture
			f = newFleet(t, 2, Config{Timeout: 10 * time.Second, Lease: 30 * time.Second}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
				if err := f.redis.Client().Do(context.Background(), "CLIENT", "PAUSE", 20000, "WRITE").Err(); err != nil {
					t.Errorf("CLIENT PAUSE: %v", err)
				}
				if tc.length {
					w.Header().Set("Content-Length", strconv.Itoa(len(tc.body)))
				}
				io.WriteString(w, tc.body)
			})
			rc := f.redis.Client()
			unpause := func() { rc.Do(context.Background(), "CLIENT", "UNPAUSE") }
			t.Cleanup(unpause)
			a, b := f.insts[0], f.insts[1]
			u := f.origin.URL + "/paused"
			if g := a.getNow(u); g.status != 200 || g.xcache != dedup.CacheMiss || g.body != tc.body {
				t.Fatalf("leader: %d %s, %d bytes %v", g.status, g.xcache, len(g.body), g.err)
			}
			if st := a.engine.Stats(); st.Flights != 1 || st.Sharing != 1 {
				t.Fatalf("A while Redis takes no writes: %d flights in progress, %d sharing, want 1 and 1 (the value not stored yet)", st.Flights, st.Sharing)
			}
			if g := a.getNow(u); g.xcache != dedup.CacheHit || g.body != tc.body {
				t.Fatalf("A again, meanwhile: %s, %d bytes %v, want a HIT", g.xcache, len(g.body), g.err)
			}
			unpause()
			f.settle(t)
			if g := b.get(u); g.xcache != dedup.CacheHit || g.body != tc.body {
				t.Fatalf("B once Redis took the value: %s, %d bytes %v, want a HIT", g.xcache, len(g.body), g.err)
			}
			if n := f.hits.Load(); n != 1 {
				t.Fatalf("origin saw %d requests, want 1", n)
			}
		})
	}
}
