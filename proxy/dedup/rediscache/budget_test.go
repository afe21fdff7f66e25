package rediscache

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// tripLog is a go-redis hook that records every round trip a client makes
// to Redis: one command, or one pipeline of several.
type tripLog struct {
	mu    sync.Mutex
	trips [][]string // each trip's commands, as their arguments joined by spaces
}

func (l *tripLog) DialHook(next redis.DialHook) redis.DialHook { return next }

func (l *tripLog) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		l.record(cmd)
		return next(ctx, cmd)
	}
}

func (l *tripLog) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		l.record(cmds...)
		return next(ctx, cmds)
	}
}

func (l *tripLog) record(cmds ...redis.Cmder) {
	trip := make([]string, len(cmds))
	for i, c := range cmds {
		args := make([]string, len(c.Args()))
		for j, a := range c.Args() {
			s := fmt.Sprint(a)
			if b, ok := a.([]byte); ok {
				s = fmt.Sprintf("<%d bytes>", len(b))
			}
			args[j] = s
		}
		if name, ok := scriptNames[args[min(1, len(args)-1)]]; ok {
			args[1] = name
		}
		trip[i] = strings.Join(args, " ")
	}
	l.mu.Lock()
	l.trips = append(l.trips, trip)
	l.mu.Unlock()
}

var scriptNames = map[string]string{
	joinScript.Hash(): "(join)", finishScript.Hash(): "(finish)", storedScript.Hash(): "(stored)",
	renewScript.Hash(): "(renew)", releaseScript.Hash(): "(release)",
}

// names shortens commands to their name and, for a script, which one.
func names(cmds []string) []string {
	out := make([]string, len(cmds))
	for i, c := range cmds {
		f := strings.Fields(c)
		out[i] = f[0]
		if len(f) > 1 && strings.HasPrefix(f[1], "(") {
			out[i] += f[1]
		}
	}
	return out
}

// about returns the round trips, and the commands in them, that name the
// hash tag of key (its value, lock, outcome, waiters) or a URL index.
func (l *tripLog) about(key string) (trips int, cmds []string) {
	tag := tagOf(key)
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, trip := range l.trips {
		if ours(trip, tag) {
			trips++
			cmds = append(cmds, trip...)
		}
	}
	return trips, cmds
}

// others counts the round trips that name none of the keys' tags.
func (l *tripLog) others(keys []string) (trips int, sample []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
next:
	for _, trip := range l.trips {
		if handshake(trip) {
			// A connection opening (the pool replacing one that timed
			// out on a loaded machine), not work any request asked for.
			continue
		}
		for _, k := range keys {
			if ours(trip, tagOf(k)) {
				continue next
			}
		}
		trips++
		if len(sample) < 5 {
			sample = append(sample, strings.Join(trip, "; "))
		}
	}
	return trips, sample
}

// handshake reports a round trip of a new connection's set-up: HELLO and
// CLIENT SETNAME/SETINFO.
func handshake(trip []string) bool {
	for _, c := range trip {
		if !strings.HasPrefix(c, "hello ") && !strings.HasPrefix(c, "client ") {
			return false
		}
	}
	return len(trip) > 0
}

func ours(trip []string, tag string) bool {
	for _, c := range trip {
		if strings.Contains(c, tag) {
			return true
		}
	}
	return false
}

// snapshot copies the log as it is now.
func (l *tripLog) snapshot() *tripLog {
	l.mu.Lock()
	defer l.mu.Unlock()
	return &tripLog{trips: append([][]string(nil), l.trips...)}
}

func (l *tripLog) reset() {
	l.mu.Lock()
	l.trips = nil
	l.mu.Unlock()
}

// TestRoundTripBudget counts what the shared store costs per request, with
// a go-redis hook on each instance's client: a miss costs its leader at
// most 2 round trips (learn "not there, you lead"; store, index, release
// and publish), a hit whose local copy has expired 1, a waiter on another
// instance's flight 1 before it waits. Nothing else goes to Redis per
// request: the statistics are flushed in the background.
func TestRoundTripBudget(t *testing.T) {
	release := make(chan struct{})
	arrived := make(chan string, 16)
	f := newFleet(t, 2, Config{
		LocalTTL:     50 * time.Millisecond,
		PollInterval: time.Minute, // no polling: count what a wait costs without it
		StatsFlush:   time.Hour,
	}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/slow") {
			arrived <- r.URL.Path
			<-release
		}
		w.Header().Set("Content-Type", "text/plain")
		fmt.Fprintf(w, "page %s", r.URL.Path)
	})
	a, b := f.insts[0], f.insts[1]
	logA, logB := &tripLog{}, &tripLog{}
	a.store.rdb.AddHook(logA)
	b.store.rdb.AddHook(logB)
	// Load the scripts once (a first EVALSHA answers NOSCRIPT).
	for _, inst := range f.insts {
		if g := inst.get(f.origin.URL + "/warm-" + inst.name); g.status != 200 {
			t.Fatalf("warm-up: %+v", g)
		}
	}
	logA.reset()
	logB.reset()

	check := func(what string, l *tripLog, key string, budget int) {
		t.Helper()
		n, cmds := l.about(key)
		t.Logf("%s: %d round trips, %d commands: %v", what, n, len(cmds), names(cmds))
		if n > budget {
			t.Errorf("%s: %d round trips to Redis, budget %d", what, n, budget)
		}
	}

	// A miss: A leads.
	miss := a.get(f.origin.URL + "/miss")
	if miss.xcache != dedup.CacheMiss {
		t.Fatalf("first request: %+v", miss)
	}
	check("leader, miss", logA, miss.key, 2)

	// A hit on the other instance (nothing in its memory tier).
	if g := b.get(f.origin.URL + "/miss"); g.xcache != dedup.CacheHit {
		t.Fatalf("B: %+v", g)
	}
	check("hit on another instance", logB, miss.key, 1)

	// A hit on the same instance once its memory copy is too old to trust.
	logA.reset()
	time.Sleep(100 * time.Millisecond)
	if g := a.get(f.origin.URL + "/miss"); g.xcache != dedup.CacheHit {
		t.Fatalf("A after local_ttl: %+v", g)
	}
	check("hit after local_ttl", logA, miss.key, 1)

	// A waiter on another instance's flight.
	logA.reset()
	logB.reset()
	resA := make(chan got, 1)
	go func() { resA <- a.get(f.origin.URL + "/slow") }()
	<-arrived
	resB := make(chan got, 1)
	go func() { resB <- b.get(f.origin.URL + "/slow") }()
	testkit.Eventually(t, testkit.Patience, func() bool { return b.store.fleetWaits.Load() == 1 }, "B waiting on A's flight")
	before := logB.snapshot()
	close(release)
	ga, gb := <-resA, <-resB
	if ga.xcache != dedup.CacheMiss || gb.xcache != dedup.CacheCoalesced || ga.key != gb.key {
		t.Fatalf("A %+v, B %+v", ga, gb)
	}
	key := ga.key
	check("waiter before waiting", before, key, 1)
	check("leader with a waiter elsewhere", logA, key, 2)
	check("waiter, whole request", logB, key, 2)

	// Nothing per request besides the flights: 20 misses and 20 hits.
	logA.reset()
	start := time.Now()
	var keys []string
	for i := range 20 {
		g := a.get(fmt.Sprintf("%s/many/%d", f.origin.URL, i))
		if g.xcache != dedup.CacheMiss {
			t.Fatalf("many %d: %+v", i, g)
		}
		keys = append(keys, g.key)
		if g := a.get(fmt.Sprintf("%s/many/%d", f.origin.URL, i)); g.xcache != dedup.CacheHit {
			t.Fatalf("many %d again: %+v", i, g)
		}
	}
	total := 0
	for _, k := range keys {
		n, _ := logA.about(k)
		total += n
	}
	others, sample := logA.others(keys)
	// The only background work in this window is the heartbeat.
	allowed := 2 + int(time.Since(start)/(a.store.cfg.PresenceTTL/3))
	t.Logf("20 misses and 20 hits: %d round trips about their keys, %d others %q", total, others, sample)
	if total > 2*len(keys) {
		t.Errorf("20 misses cost %d round trips, budget %d", total, 2*len(keys))
	}
	if others > allowed {
		t.Errorf("%d other round trips during 40 requests (allowed %d): %q", others, allowed, sample)
	}
}

// TestCommandBudget counts what Redis itself executes per unique miss,
// the scripts' own calls included (INFO's total_commands_processed, which
// the sizing plan in the README multiplies out), and fails above the
// budget: GET, the join script and its 3 calls, SET, storedScript and its
// 2 calls, SADD and PEXPIRE of the URL index. The background (heartbeat,
// its presence key) is allowed for on top.
func TestCommandBudget(t *testing.T) {
	const budget = 11
	f := newFleet(t, 1, Config{StatsFlush: time.Hour}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		fmt.Fprintf(w, "page %s", r.URL.Path)
	})
	a := f.insts[0]
	if g := a.get(f.origin.URL + "/warm"); g.status != 200 { // loads the scripts
		t.Fatalf("warm-up: %+v", g)
	}
	processed := func() int64 { return f.redis.Stats().Commands }
	const misses = 200
	before, start := processed(), time.Now()
	for i := range misses {
		if g := a.get(fmt.Sprintf("%s/u/%d", f.origin.URL, i)); g.xcache != dedup.CacheMiss {
			t.Fatalf("miss %d: %+v", i, g)
		}
	}
	// The INFO itself, and the heartbeat: a few commands per beat.
	background := 1 + 4*(1+int64(time.Since(start)/(a.store.cfg.PresenceTTL/3)))
	used := processed() - before
	perMiss := float64(used-background) / misses
	t.Logf("%d misses: %d commands processed (%.2f each beyond the background)", misses, used, perMiss)
	if used > budget*misses+background {
		t.Errorf("%d misses cost Redis %d commands, budget %d each (+%d background)", misses, used, budget, background)
	}
}
