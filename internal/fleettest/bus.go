package fleettest

import (
	"context"
	"io"
	"maps"
	"math"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// Prices are what a factory prices its instances' savings at (dedup's
// Options.Savings), which FleetStatsAddUp checks the money against.
var Prices = dedup.SavingsConfig{PricePer1000Requests: 2, PricePerGB: 8}

// FleetStatsAddUp: the per-day counters in the store sum every instance's
// answers, with the bytes and money they saved; the fleet's statistics
// name the store and say it is available. It returns the statistics it
// checked, for a store's test to go on from.
func FleetStatsAddUp(t *testing.T, newFleet Factory) dedup.FleetStats {
	f := newFleet(t, Options{Instances: 2, StatsFlush: 20 * time.Millisecond}, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "0123456789")
	})
	a, b := f.Insts[0], f.Insts[1]
	a.Get(f.Origin.URL + "/s") // MISS
	b.Get(f.Origin.URL + "/s") // HIT (10 bytes avoided)
	b.Get(f.Origin.URL + "/s") // HIT
	a.Get(f.Origin.URL + "/t") // MISS
	var fs dedup.FleetStats
	testkit.Eventually(t, testkit.Patience, func() bool {
		var err error
		fs, err = a.Bus.FleetStats(context.Background())
		return err == nil && fs.Today.Requests == 4
	}, "stats flushed")
	d := fs.Today
	if d.XCache["HIT"] != 2 || d.XCache["MISS"] != 2 || d.BySource["dedup_cache"] != 2 || d.SavingsPct != 50 || d.BytesAvoided != 20 {
		t.Fatalf("today: %+v", d)
	}
	// Two HITs of 10 bytes at 2 per 1,000 requests and 8 per GB.
	if want := 2 * (2.0/1000 + 10*8/1e9); math.Abs(d.MoneySaved-want) > 1e-12 {
		t.Fatalf("money saved today %v, want %v", d.MoneySaved, want)
	}
	if fs.Last7Days.Requests != 4 || len(fs.Days) != f.StatsDays || fs.Store != f.Store || !fs.Available {
		t.Fatalf("7 days: %+v", fs)
	}
	return fs
}

// NotesReachTheOtherInstances: a note published by one instance reaches
// the others' handler for its topic, never its own, and a note on another
// topic reaches nobody's handler for this one.
func NotesReachTheOtherInstances(t *testing.T, newFleet Factory) {
	f := newFleet(t, Options{Instances: 2}, func(w http.ResponseWriter, r *http.Request) {})
	a, b := f.Insts[0], f.Insts[1]
	var mu sync.Mutex
	heard := map[string][]string{}
	for _, inst := range f.Insts {
		inst.Bus.Subscribe("session", func(msg string, _ time.Duration) {
			mu.Lock()
			heard[inst.Name] = append(heard[inst.Name], msg)
			mu.Unlock()
		})
	}
	received := func(name string) []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), heard[name]...)
	}
	// The subscription may take a moment to be live: publish until heard.
	testkit.Eventually(t, testkit.Patience, func() bool {
		a.Bus.Publish("other", "", "not for session handlers", 0)
		a.Bus.Publish("session", "", `{"session":"s1","kind":"cooldown"}`, 0)
		time.Sleep(20 * time.Millisecond)
		return len(received(b.Name)) > 0
	}, "b to hear a")
	for _, m := range received(b.Name) {
		if m != `{"session":"s1","kind":"cooldown"}` {
			t.Errorf("b heard %q", m)
		}
	}
	if m := received(a.Name); len(m) != 0 {
		t.Errorf("a heard its own notes: %q", m)
	}
}

// LastingNotesAreRecalled: a lasting note is kept until it expires, in
// the store's clock, and handed to instances that subscribe later; a
// shorter note on the same key does not replace a longer one; expired
// notes are gone.
func LastingNotesAreRecalled(t *testing.T, newFleet Factory) {
	f := newFleet(t, Options{Instances: 2}, func(w http.ResponseWriter, r *http.Request) {})
	a, b := f.Insts[0].Bus, f.Insts[1].Bus
	// A fresh subscription recalls what is kept (left > 0); notes heard
	// live meanwhile (left 0, on the events goroutine) are not recalls.
	recall := func() map[string]time.Duration {
		var mu sync.Mutex
		m := map[string]time.Duration{}
		b.Subscribe("session", func(msg string, left time.Duration) {
			if left > 0 {
				mu.Lock()
				m[msg] = left
				mu.Unlock()
			}
		})
		mu.Lock()
		defer mu.Unlock()
		return maps.Clone(m)
	}
	a.Publish("session", "s1", "long", time.Minute)
	testkit.Eventually(t, testkit.Patience, func() bool { return len(recall()) == 1 }, "the note to be kept")
	a.Publish("session", "s1", "short", 200*time.Millisecond)
	a.Publish("session", "s2", "brief", 200*time.Millisecond)
	testkit.Eventually(t, testkit.Patience, func() bool { _, ok := recall()["brief"]; return ok }, "the second key")
	kept := recall()
	if left, ok := kept["long"]; !ok || left < 50*time.Second || left > time.Minute {
		t.Errorf("long note: %v (all %+v)", left, kept)
	}
	if _, ok := kept["short"]; ok {
		t.Errorf("a shorter note replaced a longer one: %+v", kept)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { _, ok := recall()["brief"]; return !ok }, "the brief note to expire")
	if _, ok := recall()["long"]; !ok {
		t.Error("the long note went with the brief one")
	}
}

// ClaimIsExclusiveAcrossInstances: one instance at a time holds a claim;
// releasing it lets the next in; it lapses by itself. Where the factory
// can kill the server (Fleet.Kill), with the store gone every caller may
// proceed: a claim that cannot be checked must not stop the work it
// guards.
func ClaimIsExclusiveAcrossInstances(t *testing.T, newFleet Factory) {
	f := newFleet(t, Options{Instances: 2}, func(w http.ResponseWriter, r *http.Request) {})
	a, b := f.Insts[0].Bus, f.Insts[1].Bus
	ctx := context.Background()
	release, ok := a.Claim(ctx, "rotate:s1", time.Minute)
	if !ok {
		t.Fatal("first claim refused")
	}
	if _, ok := b.Claim(ctx, "rotate:s1", time.Minute); ok {
		t.Fatal("a held claim was granted to another instance")
	}
	if _, ok := b.Claim(ctx, "rotate:s2", time.Minute); !ok {
		t.Fatal("claims on other names interfere")
	}
	release()
	if _, ok := b.Claim(ctx, "rotate:s1", 100*time.Millisecond); !ok {
		t.Fatal("a released claim stayed held")
	}
	if _, ok := a.Claim(ctx, "rotate:s1", time.Minute); ok {
		t.Fatal("a claim was granted twice")
	}
	testkit.Eventually(t, testkit.Patience, func() bool {
		_, ok := a.Claim(ctx, "rotate:s1", time.Minute)
		return ok
	}, "the claim to lapse")
	if f.Kill == nil {
		return
	}
	f.Kill()
	if _, ok := b.Claim(ctx, "rotate:s1", time.Minute); !ok {
		t.Fatal("with the store gone a claim must not block the work it guards")
	}
}

// StatsLink is one instance's statistics as StatsLostAnswerCountsOnce
// drives them: the instance reaches the store through Relay, and flushes
// only when told (its own flush interval is long).
type StatsLink struct {
	Relay *testkit.Relay
	// Counts are what the instance flushes next.
	Counts *dedup.DayCounts
	// Flush is one flush, as the instance's own loop runs it.
	Flush func()
	// Stored is the fleet's count of a kind ("hit", "miss", "bypass"),
	// as the store holds it.
	Stored func(kind string) int64
	// Prompt: the first two flushes after one whose answer was lost
	// deliver both batches. Redis's do. PostgreSQL's do not: while the
	// muted flush waits out its statement timeout (2 s in its tests), the
	// instance's other statements (its probe's) time out behind the same
	// relay, the breaker opens, and flushes wait for breaker_interval;
	// the batch goes, once, at the first flush after.
	Prompt bool
}

// StatsLostAnswerCountsOnce: a flush whose answer the network lost (the
// store added it) is sent again, as it was, and the store adds it only
// once; a flush that never reached the store is sent again until it does.
func StatsLostAnswerCountsOnce(t *testing.T, l StatsLink) {
	l.Counts.Bypass.Add(1)
	// A flush that goes through first: the link is up, Redis knows the
	// flush's script (an EVALSHA it does not know is not run), and
	// PostgreSQL's pool keeps a connection (the muted flush needs no new
	// one).
	testkit.Eventually(t, testkit.Patience, func() bool {
		l.Flush()
		return l.Stored("bypass") == 1
	}, "a flush through the relay")
	l.Counts.Miss.Add(10)
	l.Relay.Mute(true)
	l.Flush()
	l.Relay.Mute(false)
	if n := l.Stored("miss"); n != 10 {
		t.Fatalf("miss = %d once the muted flush reached the store, want 10", n)
	}
	l.Counts.Miss.Add(5)
	l.Flush() // the lost one again, then the new counts
	l.Flush()
	if l.Prompt {
		if n := l.Stored("miss"); n != 15 {
			t.Errorf("miss = %d after flushing 10 (answer lost) and 5, want 15", n)
		}
	}
	testkit.Eventually(t, testkit.Patience, func() bool {
		l.Flush()
		return l.Stored("miss") >= 15
	}, "the flush sent again and the new counts")
	l.Flush() // nothing left to send
	if n := l.Stored("miss"); n != 15 {
		t.Errorf("miss = %d after flushing 10 (answer lost) and 5, want 15", n)
	}

	// Never sent: the counts wait for the next flush.
	l.Relay.Cut(true)
	l.Counts.Hit.Add(3)
	l.Flush()
	l.Relay.Cut(false)
	testkit.Eventually(t, testkit.Patience, func() bool {
		l.Flush()
		return l.Stored("hit") == 3
	}, "the counts of a flush that never reached the store to arrive")
}
