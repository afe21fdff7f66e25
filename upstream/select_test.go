package upstream

import (
	"context"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// testGroup is the provider of testSessions.
var testGroup = newProvider(ProviderConfig{Name: "test"}, false, dedupPrice0)

// testSessions builds bare sessions for selection tests (no transports),
// all in testGroup.
func testSessions(weights ...int) []*session {
	var list []*session
	for i, w := range weights {
		id := fmt.Sprintf("s%02d", i)
		s := &session{id: id, idHash: mix64(hashStrings(id)), baseWeight: w, rotation: RotationSticky, gw: &gateway{}, h: new(health)}
		s.prov.Store(testGroup)
		s.h.init(w)
		list = append(list, s)
	}
	return list
}

// testSet indexes sessions whose groups are among groups (testGroup when
// none are given).
func testSet(list []*session, groups ...*provider) *sessionSet {
	if len(groups) == 0 {
		groups = []*provider{testGroup}
	}
	sortGroups(groups)
	return newSessionSet(list, groups)
}

// req is the selection input of a request of account with hint (host, key).
func req(r *rule, account, hint, host, key string) pickReq {
	return r.pickRequest(clientinfo.Info{Account: account, Session: hint, Key: key}, host)
}

func owners(p *Pool, set *sessionSet, keys int, now time.Time) []*session {
	out := make([]*session, keys)
	for k := range keys {
		pr := req(p.st.Load().defRule, "acct", "", "", "")
		pr.bucket, pr.bucketH = true, hashStrings("key", fmt.Sprint(k))
		pr.sticky = pr.bucketH
		out[k] = p.pick(context.Background(), set, &pr, now, nil)
	}
	return out
}

func newTestPool() *Pool {
	p := &Pool{now: time.Now}
	st := &setup{cfg: Config{}.WithDefaults()}
	st.rules, st.defRule = compileRules(st.cfg)
	p.st.Store(st)
	return p
}

// TestRendezvousMovesOnlyTheCoolingSessionsKeys is the property that makes
// sticky keys survive a cooldown: over 1000 keys, putting one session in
// cooldown moves exactly the keys it owned, and its return brings exactly
// them back.
func TestRendezvousMovesOnlyTheCoolingSessionsKeys(t *testing.T) {
	p := newTestPool()
	list := testSessions(5, 5, 3, 8, 5, 1, 10, 5)
	set := testSet(list)
	t0 := time.Unix(1_000_000, 0)
	const keys = 1000
	before := owners(p, set, keys, t0)
	for victim := range list {
		v := list[victim]
		v.h.mark(outcomeConnError, t0, 0, "")
		during := owners(p, set, keys, t0)
		moved, owned := 0, 0
		for k := range keys {
			switch {
			case before[k] == v:
				owned++
				if during[k] == v {
					t.Fatalf("key %d still on cooling session %s", k, v.id)
				}
				moved++
			case during[k] != before[k]:
				t.Fatalf("key %d moved from %s to %s although %s was not its owner", k, before[k].id, during[k].id, v.id)
			}
		}
		if moved != owned {
			t.Fatalf("moved %d keys, %s owned %d", moved, v.id, owned)
		}
		v.h.mark(outcomeOK, t0, 0, "") // ends the cooldown
		after := owners(p, set, keys, t0)
		for k := range keys {
			if after[k] != before[k] {
				t.Fatalf("key %d did not return to %s after the cooldown", k, before[k].id)
			}
		}
	}
}

// TestRendezvousFollowsWeights: a session's share of sticky keys is
// proportional to its configured weight.
func TestRendezvousFollowsWeights(t *testing.T) {
	p := newTestPool()
	list := testSessions(1, 2, 3, 4)
	set := testSet(list)
	const keys = 20000
	count := map[*session]int{}
	for _, s := range owners(p, set, keys, time.Now()) {
		count[s]++
	}
	for _, s := range list {
		want := float64(keys) * float64(s.baseWeight) / 10
		if got := float64(count[s]); math.Abs(got-want) > 0.1*want {
			t.Errorf("%s (weight %d) owns %v keys, want about %v", s.id, s.baseWeight, got, want)
		}
	}
}

// TestStickyPrefersStableIPs: a per_request session changes IP on every
// connection, so a sticky key lands on it only when nothing else is left.
func TestStickyPrefersStableIPs(t *testing.T) {
	p := newTestPool()
	list := testSessions(10, 1)
	list[0].perRequest = true
	set := testSet(list)
	t0 := time.Unix(1_000_000, 0)
	for _, s := range owners(p, set, 200, t0) {
		if s != list[1] {
			t.Fatalf("sticky key on the per_request session")
		}
	}
	list[1].h.mark(outcomeConnError, t0, 0, "")
	for _, s := range owners(p, set, 200, t0) {
		if s != list[0] {
			t.Fatalf("sticky key not on the only available session")
		}
	}
}

func TestWeightedRandomFollowsHealthWeights(t *testing.T) {
	p := newTestPool()
	list := testSessions(5, 5)
	list[0].h.init(1)
	list[1].h.init(9)
	set := testSet(list)
	pr := req(p.st.Load().defRule, "", "", "", "")
	n0 := 0
	const n = 20000
	for range n {
		if p.pick(context.Background(), set, &pr, time.Now(), nil) == list[0] {
			n0++
		}
	}
	if got := float64(n0) / n; math.Abs(got-0.1) > 0.02 {
		t.Errorf("weight 1 of 10 picked %.3f of the time, want about 0.1", got)
	}
	// Skipped and cooling sessions are never picked.
	for range 100 {
		if s := p.pick(context.Background(), set, &pr, time.Now(), []*session{list[1]}); s != list[0] {
			t.Fatal("picked a skipped session")
		}
	}
	list[0].h.mark(outcomeRateLimited, time.Now(), 0, "")
	if s := p.pick(context.Background(), set, &pr, time.Now(), []*session{list[1]}); s != nil {
		t.Fatalf("picked %s although everything is cooling or skipped", s.id)
	}
}

func TestHintNamesASessionOrIsAStickyKey(t *testing.T) {
	p := newTestPool()
	list := testSessions(5, 5, 5)
	set := testSet(list)
	now := time.Now()
	pr := req(p.st.Load().defRule, "acct", "s02", "", "")
	if s := p.pick(context.Background(), set, &pr, now, nil); s != list[2] {
		t.Fatalf("hint naming s02 picked %s", s.id)
	}
	// Any other hint is a sticky key: stable, scoped by account.
	pr = req(p.st.Load().defRule, "acct", "my_crawl_17", "", "")
	first := p.pick(context.Background(), set, &pr, now, nil)
	for range 20 {
		if p.pick(context.Background(), set, &pr, now, nil) != first {
			t.Fatal("hint is not sticky")
		}
	}
}

func TestBindingsAreBoundedAndExpire(t *testing.T) {
	var b bindings
	now := time.Unix(1_000_000, 0).UnixNano()
	b.put(42, "s1", now)
	if id, ok := b.get(42, now+int64(time.Minute)); !ok || id != "s1" {
		t.Fatalf("get = %q %v", id, ok)
	}
	if _, ok := b.get(42, now+int64(bindingTTL)); ok {
		t.Fatal("binding outlived its TTL")
	}
	for k := range uint64(200_000) {
		b.put(k*7919+1, "s1", now)
	}
	total := 0
	for i := range b.shards {
		total += len(b.shards[i].cur) + len(b.shards[i].old)
	}
	if total > 2*bindingShards*bindingsPerGen {
		t.Fatalf("%d bindings kept, bound is %d", total, 2*bindingShards*bindingsPerGen)
	}
	// Recent keys survive.
	if _, ok := b.get(199_999*7919+1, now); !ok {
		t.Fatal("most recent binding lost")
	}
}

// BenchmarkSelect measures choosing a session among 50, the hot path of
// every request.
func BenchmarkSelect(b *testing.B) {
	p := newTestPool()
	weights := make([]int, 50)
	for i := range weights {
		weights[i] = 1 + i%10
	}
	list := testSessions(weights...)
	set := testSet(list)
	now := time.Now()
	for i := 0; i < 50; i += 7 {
		list[i].h.mark(outcomeRateLimited, now, 0, "")
	}
	for _, bc := range []struct {
		name                   string
		account, hint, host, k string
		rule                   *rule
	}{
		{"hint", "acct", "crawl_17", "", "", p.st.Load().defRule},
		{"rule_host", "acct", "", "shop.example", "", &rule{name: "r", sticky: StickyHost}},
		{"binding", "acct", "", "", "v1:0123456789abcdef", p.st.Load().defRule},
		{"weighted_random", "acct", "", "", "", p.st.Load().defRule},
	} {
		b.Run(bc.name, func(b *testing.B) {
			if bc.k != "" {
				pr := req(bc.rule, bc.account, bc.hint, bc.host, bc.k)
				p.bindings.put(pr.key, list[3].id, now.UnixNano())
			}
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					pr := req(bc.rule, bc.account, bc.hint, bc.host, bc.k)
					if p.pick(context.Background(), set, &pr, now, nil) == nil {
						b.Fatal("no session")
					}
				}
			})
		})
	}
}

var dedupPrice0 = dedup.Price{}
