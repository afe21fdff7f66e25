package upstream

import (
	"context"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"time"
)

// Choosing a session (see pick): the client's hint (clientinfo.Session)
// when it names a session that can take the request; else, tier by tier
// from the highest provider priority down (see provider), the first
// session the tier yields for
//
//  1. a sticky key: the client's hint when it names no session, else the
//     sticky bucket of the matching rule (host, account, account+rule);
//  2. the binding of the logical request (clientinfo.Key): the session it
//     last succeeded on, so a retried or re-queued request keeps its session;
//  3. otherwise weighted random over the available sessions, by health
//     weight.
//
// A session takes a request only when it is not cooling down and is in the
// country (and city) the request asks for, at a provider that serves that
// country. A first round leaves out the providers that cannot take
// requests (API failing, gateway refusing); a second round takes them
// after all, when nothing else could.
//
// Sticky keys map to sessions by weighted rendezvous hashing
// (HRW, "highest random weight"): every session gets the score
// -w / ln(u), u = hash(key, session id) mapped into (0,1), and the highest
// score wins. Each session wins a share of the keys proportional to w, and
// removing one session (cooldown) moves only the keys it owned; the others
// keep their winner because their scores did not change. w is the
// session's configured weight, not its health weight: health weights move
// with every success and failure, and a sticky key must not wander because
// some other session had a good minute. Health still matters: a session in
// cooldown is skipped. The hash is deterministic (FNV-1a + a splitmix64
// finalizer, no per-process seed), so every instance of a fleet maps a key
// to the same session while their session lists agree; with a fleet store
// the key's binding there decides (see bindings.go), which holds while
// they do not.
//
// Sticky keys prefer sessions whose exit IP is stable (sticky, timed): a
// per_request session changes IP on every connection, so it can honour a
// sticky key only when nothing else is available.

// pickReq is what selection needs from a request; hashes are precomputed
// so picking allocates nothing.
type pickReq struct {
	hint     string // client hint, "" if none
	hintHash uint64 // hash of (account, hint[, country, city])
	bucket   bool   // the rule has a sticky bucket for this request
	bucketH  uint64
	key      uint64 // hash of the dedup key; 0 = no binding
	// sticky is the request's sticky key (hintHash or bucketH); 0 none.
	sticky uint64
	// country and city the request must exit from; "" any.
	country, city string
	// site is the request's host (siteOf): a session that sits it out
	// (siteCool) is not picked for it.
	site string
}

// FNV-1a, 64 bit.
const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

func fnvAdd(h uint64, s string) uint64 {
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= fnvPrime
	}
	// A separator byte, so ("ab","c") and ("a","bc") differ.
	h ^= 0xff
	h *= fnvPrime
	return h
}

func hashStrings(parts ...string) uint64 {
	h := uint64(fnvOffset)
	for _, p := range parts {
		h = fnvAdd(h, p)
	}
	return h
}

// mix64 is the splitmix64 finalizer: FNV alone leaves similar keys with
// correlated high bits, which would bias the scores.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// hrwScore is the weighted rendezvous score of a session for a key.
func hrwScore(key uint64, s *session) float64 {
	h := mix64(key ^ s.idHash)
	u := (float64(h>>11) + 0.5) / (1 << 53) // uniform in (0,1), never 0 or 1
	return -float64(s.baseWeight) / math.Log(u)
}

// hrw returns the session with the highest score among those usable,
// preferring stable-IP sessions; nil if none is usable.
func hrw(list []*session, key uint64, usable func(*session) bool) *session {
	var best, bestAny *session
	var bs, bsAny float64
	for _, s := range list {
		if !usable(s) {
			continue
		}
		sc := hrwScore(key, s)
		if bestAny == nil || sc > bsAny {
			bestAny, bsAny = s, sc
		}
		if !s.perRequest && (best == nil || sc > bs) {
			best, bs = s, sc
		}
	}
	if best != nil {
		return best
	}
	return bestAny
}

// weightedRandom picks a usable session with probability proportional to
// its health weight; nil if none is usable.
func weightedRandom(list []*session, usable func(*session) bool) *session {
	total := 0
	for _, s := range list {
		if usable(s) {
			total += s.h.currentWeight()
		}
	}
	if total <= 0 {
		return nil
	}
	n := rand.IntN(total)
	var last *session
	for _, s := range list {
		if !usable(s) {
			continue
		}
		last = s
		if n -= s.h.currentWeight(); n < 0 {
			return s
		}
	}
	// Weights moved between the two passes (a concurrent mark): any
	// usable session is as good an answer.
	return last
}

// usable reports whether s may take an attempt of pr at now (unix nanos):
// not cooling, for every site or the request's, in its country and city, not among skip (the
// sessions this request tried). strict also leaves out the sessions of a
// provider whose API keeps failing or whose gateway refuses connections.
func usable(s *session, pr *pickReq, now int64, skip []*session, strict bool) bool {
	if !s.h.available(now) || s.h.siteCooling(pr.site, now) || !inPlace(s, pr) {
		return false
	}
	if slices.Contains(skip, s) {
		return false
	}
	return !strict || !(s.prov.Load().apiDown.Load() || s.gw.down(now))
}

// inPlace reports whether s exits where pr asks: in its country (at a
// provider that serves it) and city.
func inPlace(s *session, pr *pickReq) bool {
	if pr.country != "" && (s.country != pr.country || !s.prov.Load().serves(pr.country)) {
		return false
	}
	return pr.city == "" || s.city == pr.city
}

// pick chooses a session for one attempt. skip lists sessions already
// tried by this request. It returns nil when no session is available.
func (p *Pool) pick(ctx context.Context, set *sessionSet, pr *pickReq, now time.Time, skip []*session) *session {
	nowN := now.UnixNano()
	for _, strict := range [...]bool{true, false} {
		ok := func(s *session) bool { return usable(s, pr, nowN, skip, strict) }
		if pr.hint != "" {
			if s := set.byID[pr.hint]; s != nil && ok(s) {
				return s
			}
		}
		for _, tier := range set.tiers {
			s := p.pickIn(tier, pr, nowN, ok)
			if s == nil {
				continue
			}
			if pr.sticky != 0 && p.fleet != nil {
				return p.agree(ctx, pr, s, ok, skip)
			}
			return s
		}
	}
	return nil
}

// pickIn chooses among the sessions of one tier.
func (p *Pool) pickIn(tier []*session, pr *pickReq, now int64, ok func(*session) bool) *session {
	if pr.sticky != 0 {
		return hrw(tier, pr.sticky, ok)
	}
	if pr.key != 0 {
		if id, found := p.bindings.get(pr.key, now); found {
			for _, s := range tier {
				if s.id == id {
					if ok(s) {
						return s
					}
					break
				}
			}
		}
	}
	return weightedRandom(tier, ok)
}

// bindings remembers which session each logical request (dedup key) last
// succeeded on, so a request retried or re-queued by the client goes back
// to it. Bounded: per shard, two generations of at most bindingsPerGen
// entries; when the current one fills, the old one is dropped whole (an
// LRU approximation with no per-entry bookkeeping). Entries also expire
// after bindingTTL. Keys are 64-bit hashes: a collision only means one
// request starts on another request's session.
type bindings struct {
	ttl    time.Duration // how long an entry holds; 0 means bindingTTL
	shards [bindingShards]bindShard
}

func (b *bindings) life() time.Duration {
	if b.ttl == 0 {
		return bindingTTL
	}
	return b.ttl
}

const (
	bindingShards  = 16
	bindingsPerGen = 2048 // per shard: at most 2×16×2048 = 64Ki entries
	bindingTTL     = 10 * time.Minute
)

type binding struct {
	id  string
	exp int64 // unix nanos
}

type bindShard struct {
	mu       sync.Mutex // guards cur and old
	cur, old map[uint64]binding
}

func (b *bindings) shard(key uint64) *bindShard { return &b.shards[key%bindingShards] }

func (b *bindings) get(key uint64, now int64) (string, bool) {
	sh := b.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e, ok := sh.cur[key]
	if !ok {
		if e, ok = sh.old[key]; ok {
			sh.putLocked(key, e) // still in use: keep it in the young generation
		}
	}
	if !ok || e.exp <= now {
		return "", false
	}
	return e.id, true
}

// clear forgets every binding (the sessions changed under them).
func (b *bindings) clear() {
	for i := range b.shards {
		sh := &b.shards[i]
		sh.mu.Lock()
		sh.cur, sh.old = nil, nil
		sh.mu.Unlock()
	}
}

func (b *bindings) put(key uint64, id string, now int64) {
	sh := b.shard(key)
	sh.mu.Lock()
	ttl := b.life()
	if e, ok := sh.cur[key]; !ok || e.id != id || e.exp-now < int64(ttl/2) {
		sh.putLocked(key, binding{id: id, exp: now + int64(ttl)})
	}
	sh.mu.Unlock()
}

func (sh *bindShard) putLocked(key uint64, e binding) {
	if sh.cur == nil {
		sh.cur = make(map[uint64]binding)
	}
	if len(sh.cur) >= bindingsPerGen {
		sh.old, sh.cur = sh.cur, make(map[uint64]binding)
	}
	sh.cur[key] = e
}
