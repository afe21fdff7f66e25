package rediscache

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fleettest"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/storecodec"
)

// TestForeignTypesAreRemoved: a flight's value or lock key holding a list
// (another program's, another version's) is removed and counted as
// rejected input; the request is served through the fleet as usual, and
// however often it happens, the breaker stays closed: bad data is not an
// outage.
func TestForeignTypesAreRemoved(t *testing.T) {
	f := newFleet(t, 1, Config{}, dedup.Config{TTL: time.Millisecond * 50}, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "fresh")
	})
	inst := f.insts[0]
	rc := f.redis.Client()
	ctx := context.Background()
	u := f.origin.URL + "/foreign"
	tag := tagOf(inst.get(u).key)
	for _, k := range []struct{ name, key string }{
		{"value", inst.store.valueKey(tag)},
		{"lock", inst.store.lockKey(tag)},
	} {
		// More times than the breaker's failures in a row.
		for i := range 2 * breakerFailures(inst) {
			time.Sleep(60 * time.Millisecond) // the cached copy expires
			rejected := inst.be.Rejected()
			rc.Del(ctx, k.key)
			if err := rc.RPush(ctx, k.key, "not", "ours").Err(); err != nil {
				t.Fatal(err)
			}
			g := inst.get(u)
			if g.status != 200 || g.body != "fresh" || g.xcache == dedup.CacheBypass {
				t.Fatalf("%s key a list, request %d: %+v", k.name, i, g)
			}
			if typ := rc.Type(ctx, k.key).Val(); typ == "list" {
				t.Fatalf("%s key still a list after request %d", k.name, i)
			}
			if inst.be.Rejected() == rejected {
				t.Fatalf("%s key a list, request %d: not counted as rejected", k.name, i)
			}
			if !inst.store.available() {
				t.Fatalf("%s key a list, request %d: the breaker opened", k.name, i)
			}
		}
	}
}

// breakerFailures is the breaker's failures in a row before it opens.
func breakerFailures(inst *instance) int { return inst.be.c.cfg.BreakerFailures }

// TestLockWithoutExpiryLapses: a lock that never expires and names no
// instance (not one onceproxy writes) gets the lease at the first look,
// so that the key's flights go on after it lapses instead of waiting for
// ever behind it.
func TestLockWithoutExpiryLapses(t *testing.T) {
	f := newFleet(t, 1, Config{Lease: time.Second, Timeout: 300 * time.Millisecond}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "fresh")
	})
	inst := f.insts[0]
	rc := f.redis.Client()
	ctx := context.Background()
	u := f.origin.URL + "/stuck"
	tag := tagOf(inst.get(u).key)
	inst.store.local.Delete(ctx, fullKey(tag))
	rc.Del(ctx, inst.store.valueKey(tag))
	lock := inst.store.lockKey(tag)
	if err := rc.Set(ctx, lock, "foreign", 0).Err(); err != nil {
		t.Fatal(err)
	}
	done := make(chan got, 1)
	go func() { done <- inst.get(u) }()
	testkit.Eventually(t, testkit.Patience, func() bool { return rc.PTTL(ctx, lock).Val() > 0 }, "the foreign lock to get an expiry")
	if g := <-done; g.status != 200 || g.body != "fresh" {
		t.Fatalf("behind a foreign lock: %+v", g)
	}
}

// TestLapsedLeaderLeavesTheNewFlightAlone: a leader whose lease lapsed,
// and whose flight another instance took over, ends with a failure: the
// new flight's outcome, waiters flag and lock stay as they are, so that
// the requests waiting on it get its answer, not the old one's failure.
// A leader that still holds its lock stores an outcome too big to send
// blind for its waiters, in a second trip.
func TestLapsedLeaderLeavesTheNewFlightAlone(t *testing.T) {
	f := newFleet(t, 1, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {})
	inst := f.insts[0]
	rc := f.redis.Client()
	ctx := context.Background()

	key := "v1:" + strings.Repeat("a", 64)
	l, out, err := inst.store.Join(ctx, key)
	if err != nil || out != nil || l == nil {
		t.Fatalf("Join: lease %v, outcome %v, %v", l, out, err)
	}
	tag := tagOf(key)
	lock, outcome, waiters := inst.store.lockKey(tag), inst.store.outcomeKey(tag), inst.store.waitersKey(tag)
	theirs := string(storecodec.EncodeOutcome(dedup.TooLarge(nil)))
	rc.Set(ctx, lock, "other.instance", time.Minute)
	rc.Set(ctx, outcome, theirs, time.Minute)
	rc.Set(ctx, waiters, "1", time.Minute)
	if err := l.Finish(ctx, dedup.Outcome{Err: "the old flight failed"}, 0); err != nil {
		t.Fatal(err)
	}
	if v := rc.Get(ctx, outcome).Val(); v != theirs {
		t.Errorf("the new flight's outcome became %q", v)
	}
	if rc.Exists(ctx, waiters).Val() != 1 {
		t.Error("the new flight's waiters flag is gone")
	}
	if v := rc.Get(ctx, lock).Val(); v != "other.instance" {
		t.Errorf("the new flight's lock became %q", v)
	}

	// Our own flight, waited on, ending with an outcome over the inline
	// bound.
	key2 := "v1:" + strings.Repeat("b", 64)
	l, _, err = inst.store.Join(ctx, key2)
	if err != nil || l == nil {
		t.Fatalf("Join: %v, %v", l, err)
	}
	tag2 := tagOf(key2)
	rc.Set(ctx, inst.store.waitersKey(tag2), "1", time.Minute)
	big := strings.Repeat("x", inlineOutcomeBytes+1)
	if err := l.Finish(ctx, dedup.Outcome{Err: big}, 0); err != nil {
		t.Fatal(err)
	}
	stored, err := rc.Get(ctx, inst.store.outcomeKey(tag2)).Bytes()
	if err != nil {
		t.Fatalf("the big outcome was not stored: %v", err)
	}
	if o, err := storecodec.DecodeOutcome(stored, 1<<30); err != nil || o.Err != big {
		t.Errorf("stored outcome: %v (err %.20q…)", err, o.Err)
	}
	if rc.Exists(ctx, inst.store.lockKey(tag2), inst.store.waitersKey(tag2)).Val() != 0 {
		t.Error("our lock or the waiters flag outlived the flight")
	}
}

// TestStatsFlushCountsOnce: a day's counter that holds something else
// than a number is replaced and counted as rejected input, and the other
// counters of the same flush are added once: the pipeline is no
// transaction, so putting back what Redis did add would count it again at
// every flush.
func TestStatsFlushCountsOnce(t *testing.T) {
	f := newFleet(t, 1, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {})
	inst := f.insts[0]
	b := inst.bus
	rc := f.redis.Client()
	ctx := context.Background()
	key := b.dayKey(time.Now())
	b.flushOnce(ctx)
	if err := rc.HSet(ctx, key, "hit", "not a number").Err(); err != nil {
		t.Fatal(err)
	}
	missBefore, _ := rc.HGet(ctx, key, "miss").Int64()
	rejected := inst.be.Rejected()
	for range 3 {
		b.stats.Miss.Add(10)
		b.stats.Hit.Add(1)
		b.flushOnce(ctx)
	}
	if miss, _ := rc.HGet(ctx, key, "miss").Int64(); miss != missBefore+30 {
		t.Errorf("miss = %d after adding 30 to %d", miss, missBefore)
	}
	if hit := rc.HGet(ctx, key, "hit").Val(); hit != "3" {
		t.Errorf("hit = %q, want 3 (the garbage replaced by the first flush's 1, then 2 more)", hit)
	}
	if inst.be.Rejected() == rejected {
		t.Error("the garbage counter was not counted as rejected input")
	}
}

// TestStatsLostAnswerCountsOnce: a flush whose answer the network lost
// (Redis added it) is sent again, as it was, and Redis adds it only once;
// a flush that never reached Redis is sent again until it does.
func TestStatsLostAnswerCountsOnce(t *testing.T) {
	f := newFleet(t, 0, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {})
	relay := testkit.StartRelay(t, f.redis.Addr)
	inst := f.start("muted", Config{URL: strings.Replace(f.redis.URL, f.redis.Addr, relay.Addr(), 1), StatsFlush: time.Hour, Timeout: 300 * time.Millisecond}, dedup.Config{})
	b := inst.bus
	rc := f.redis.Client()
	ctx := context.Background()
	key := b.dayKey(time.Now())
	fleettest.StatsLostAnswerCountsOnce(t, fleettest.StatsLink{
		Relay:  relay,
		Counts: &b.stats,
		Flush:  func() { b.flushOnce(ctx) },
		Stored: func(kind string) int64 {
			n, _ := rc.HGet(ctx, key, kind).Int64()
			return n
		},
		Prompt: true,
	})
}
