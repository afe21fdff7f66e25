package rediscache

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/maypok86/otter/v2"
	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/singleflight"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/fleetevent"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/storecodec"
)

// Cache is the fleet-shared cache and flight coordinator: dedup.Store and
// dedup.TieredStore (a tier in this process's memory in front of the Redis
// values) and dedup.Fleet.
//
// The memory tier keeps what it holds for its full TTL, within the memory
// store's byte bound, but answers from a copy of a shared value only for
// LocalTTL before asking Redis again: Redis has the last word, and an
// invalidation whose message was lost goes unnoticed for LocalTTL at most.
// While Redis is unavailable the memory tier is the cache: it answers with
// everything it holds, and keeps what is fetched meanwhile for its full
// TTL. Once Redis is back, a copy that Redis does not have (cached
// meanwhile, or older than a loss of Redis's data) is given back to it the
// next time it is asked for; a value Redis does have wins.
type Cache struct {
	*client
	local *dedup.MemoryStore
	// marks says, per key, how far this process may trust its memory copy
	// (see mark). A key without a mark is asked of Redis; the bound only
	// costs round trips.
	marks *otter.Cache[string, mark]

	waiters fleetevent.Waiters
	// fleetWaits counts Joins waiting on another process's flight.
	fleetWaits atomic.Int64
	// gets shares one Redis GET among concurrent lookups of a key: a
	// stampede of N clients on one instance costs one round trip, not N
	// connections out of the pool (whose exhaustion would read as Redis
	// being slow and open the breaker exactly when sharing matters most).
	gets   singleflight.Group
	held   heldLeases     // the flights this process leads
	leases sync.WaitGroup // the renewer, renewLeases
	// peer is the address of this instance's peer listener, named by
	// the leases it takes (AdvertisePeer); nil or "": none.
	peer atomic.Pointer[string]
	// hooks hear the invalidations other instances make (the engine's
	// disk tier, which this cache does not hold).
	hooks dedup.InvalidationHooks
}

// OnInvalidated implements dedup.InvalidationSource.
func (s *Cache) OnInvalidated(f func(dedup.Invalidation)) (stop func()) {
	return s.hooks.OnInvalidated(f)
}

// mark is what this process knows of its memory copy of a key.
type mark struct {
	// until: the copy answers without asking Redis until then.
	until time.Time
	// own: Redis never got this copy (it was cached while Redis was
	// unavailable), so it is given back when Redis has none.
	own bool
	// keep is when the mark itself goes: until, or for an own copy the
	// copy's expiry.
	keep time.Time
}

// maxMarks bounds the marks: the keys answered from memory in the last
// LocalTTL, and those cached during an outage. Beyond it a copy is asked of
// Redis, or, cached during an outage, fetched again.
const maxMarks = 1 << 16

var (
	_ dedup.TieredStore        = (*Cache)(nil)
	_ dedup.Fleet              = (*Cache)(nil)
	_ dedup.InvalidationSource = (*Cache)(nil)
)

// maxBody bounds what a value read from Redis may inflate to.
func (s *Cache) maxBody() int64 { return storecodec.BodyLimit(int64(s.cfg.MaxValueBytes)) }

// shareable is storecodec.Shareable at max_value_bytes.
func (s *Cache) shareable(e *dedup.Entry, value []byte) bool {
	return storecodec.Shareable(e, value, int64(s.cfg.MaxValueBytes))
}

func newCache(c *client, local *dedup.MemoryStore) *Cache {
	s := &Cache{client: c, local: local, held: heldLeases{m: make(map[*lease]time.Time)}}
	s.leases.Add(1)
	go s.renewLeases()
	s.marks = otter.Must(&otter.Options[string, mark]{
		MaximumSize: maxMarks,
		ExpiryCalculator: otter.ExpiryWritingFunc(func(e otter.Entry[string, mark]) time.Duration {
			return time.Until(e.Value.keep)
		}),
	})
	return s
}

// GetLocal implements dedup.TieredStore: the memory copy, when it may
// answer without Redis (recent enough, or Redis unavailable).
func (s *Cache) GetLocal(ctx context.Context, key string) (*dedup.Entry, error) {
	if e := s.localCopy(ctx, key); e != nil {
		return e, nil
	}
	return nil, dedup.ErrNotFound
}

func (s *Cache) localCopy(ctx context.Context, key string) *dedup.Entry {
	e, err := s.local.Get(ctx, key)
	if err != nil {
		return nil
	}
	if !s.available() {
		return e
	}
	if m, ok := s.marks.GetIfPresent(key); ok && time.Now().Before(m.until) {
		return e
	}
	return nil
}

// Get implements dedup.Store: the memory tier, then Redis. While Redis is
// unavailable it answers from the memory tier alone.
func (s *Cache) Get(ctx context.Context, key string) (*dedup.Entry, error) {
	if e := s.localCopy(ctx, key); e != nil {
		return e, nil
	}
	if !s.available() {
		return nil, dedup.ErrNotFound
	}
	// The shared GET must not end with whichever caller started it.
	ch := s.gets.DoChan(key, func() (any, error) {
		return s.getRemote(context.WithoutCancel(ctx), key)
	})
	select {
	case r := <-ch:
		if errors.Is(r.Err, errRemoteFailed) {
			// Redis away: the memory copy, however old, is the cache. Each
			// caller reads its own: the memory store unpacks an entry per
			// read, which the engine may then change (see dedup.Engine's
			// serve), so one read is never handed to the callers the GET
			// was shared by.
			if e, err := s.local.Get(ctx, key); err == nil {
				return e, nil
			}
			return nil, dedup.ErrNotFound
		}
		if r.Err != nil {
			return nil, r.Err
		}
		return r.Val.(*dedup.Entry), nil
	case <-ctx.Done():
		return nil, dedup.ErrNotFound
	}
}

// errRemoteFailed is getRemote's answer when Redis failed to answer.
var errRemoteFailed = errors.New("rediscache: redis did not answer")

// getRemote reads key's value from Redis into the memory tier.
func (s *Cache) getRemote(ctx context.Context, key string) (*dedup.Entry, error) {
	var blob []byte
	vk := s.valueKey(tagOf(key))
	err := s.exec(ctx, func(ctx context.Context) error {
		var err error
		blob, err = s.rdb.Get(ctx, vk).Bytes()
		return err
	})
	if errors.Is(err, errWrongType) {
		s.dropForeign(ctx, vk)
		return nil, dedup.ErrNotFound
	}
	if err != nil && !errors.Is(err, redis.Nil) {
		// The breaker logs the outage once instead of every request.
		return nil, errRemoteFailed
	}
	if err != nil {
		return nil, dedup.ErrNotFound
	}
	e, ok := s.decodeValue(key, blob)
	if !ok {
		return nil, dedup.ErrNotFound
	}
	s.keepShared(key, e)
	return e, nil
}

// decodeValue reads a value from Redis. One this build cannot read
// (another version's, corrupt bytes) is counted as rejected input and
// logged; it and one past its expiry in this process's clock are absent.
func (s *Cache) decodeValue(key string, blob []byte) (*dedup.Entry, bool) {
	e, err := storecodec.DecodeLimit(blob, s.maxBody())
	if err != nil {
		s.rejected.Add(1)
		s.log.Debug("redis: ignored a cached value it cannot read", "key", key, "err", err)
		return nil, false
	}
	return e, time.Now().Before(e.ExpiresAt)
}

// keepShared keeps e, a value Redis has, in the memory tier for its full
// TTL, to answer from without Redis for LocalTTL.
func (s *Cache) keepShared(key string, e *dedup.Entry) {
	if !s.keep(key, e) {
		return
	}
	until := s.trustUntil(e)
	s.marks.Set(key, mark{until: until, keep: until})
}

// keepOwn keeps e, a value Redis has not got, in the memory tier for its
// full TTL. shareable: Redis was unavailable, and gets e back when it
// returns and is asked for it; otherwise (too big for Redis) the copy
// answers for its whole TTL.
func (s *Cache) keepOwn(key string, e *dedup.Entry, shareable bool) {
	if !s.keep(key, e) {
		return
	}
	m := mark{until: e.ExpiresAt, keep: e.ExpiresAt}
	if shareable {
		m.until, m.own = s.trustUntil(e), true
	}
	s.marks.Set(key, m)
}

// trustUntil is how long a copy of a shared value answers without Redis.
func (s *Cache) trustUntil(e *dedup.Entry) time.Time {
	if t := time.Now().Add(s.cfg.LocalTTL); t.Before(e.ExpiresAt) {
		return t
	}
	return e.ExpiresAt
}

func (s *Cache) keep(key string, e *dedup.Entry) bool {
	ttl := time.Until(e.ExpiresAt)
	if ttl <= 0 {
		return false
	}
	_ = s.local.Set(context.Background(), key, e, ttl)
	return true
}

// givenBack returns this process's copy of key when Redis should have it
// but has none: cached while Redis was unavailable, or kept from before
// Redis lost its data.
func (s *Cache) givenBack(key string) *dedup.Entry {
	e, err := s.local.Get(context.Background(), key)
	if err != nil || time.Until(e.ExpiresAt) < time.Millisecond {
		return nil
	}
	if m, ok := s.marks.GetIfPresent(key); ok && m.own || s.lostBefore(e.StoredAt) {
		return e
	}
	return nil
}

// Set implements dedup.Store (used when a flight had no fleet lease): Redis
// when available (and the memory tier), the memory tier alone otherwise. A
// value over max_value_bytes stays in memory.
func (s *Cache) Set(ctx context.Context, key string, e *dedup.Entry, ttl time.Duration) error {
	if ttl <= 0 {
		return nil
	}
	e = e.Expiring(ttl)
	if !s.available() {
		s.keepOwn(key, e, true)
		return nil
	}
	blob := storecodec.Encode(e)
	if !s.shareable(e, blob) {
		s.keepOwn(key, e, false)
		return nil
	}
	err := s.exec(ctx, func(ctx context.Context) error {
		_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Set(ctx, s.valueKey(tagOf(key)), blob, ttl)
			s.index(ctx, p, e.URLKey, tagOf(key), ttl)
			return nil
		})
		return err
	})
	if err != nil {
		s.keepOwn(key, e, true)
		if errors.Is(err, dedup.ErrUnavailable) {
			return nil // degraded: kept in memory, the breaker already said so
		}
		return err
	}
	s.keepShared(key, e)
	return nil
}

// index records a key's tag under its URL so invalidation by URL finds
// every variant. The set lives in the URL's own slot (not the key's): it
// is written next to the value, not in the same script.
func (s *Cache) index(ctx context.Context, p redis.Pipeliner, urlKey, tag string, ttl time.Duration) {
	if urlKey == "" {
		return
	}
	b, life := indexBucket(ttl)
	ik := s.indexSet(urlKey, b)
	p.SAdd(ctx, ik, tag)
	// The set outlives each member's value; stale members only cost a
	// DEL of a missing key at invalidation time.
	p.PExpire(ctx, ik, life)
}

// Delete implements dedup.Store, fleet-wide: the value in Redis, and every
// process's memory tier through an event.
func (s *Cache) Delete(ctx context.Context, key string) error {
	s.forget(key)
	tag := tagOf(key)
	return s.exec(ctx, func(ctx context.Context) error {
		_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Del(ctx, s.valueKey(tag))
			p.Publish(ctx, s.channel, fleetevent.Format(fleetevent.Invalidated, tag))
			return nil
		})
		return err
	})
}

// DeleteURL implements dedup.Store, fleet-wide.
func (s *Cache) DeleteURL(ctx context.Context, urlKey string) (int, error) {
	localN, _ := s.local.DeleteURL(ctx, urlKey)
	n := 0
	// Every bucket's set (see indexBucket), and the single set of the
	// versions before them, whose instances may still run.
	sets := make([]string, 0, indexBuckets+1)
	sets = append(sets, s.urlKey(urlKey))
	for b := range indexBuckets {
		sets = append(sets, s.indexSet(urlKey, b))
	}
	err := s.exec(ctx, func(ctx context.Context) error {
		members := make([]*redis.StringSliceCmd, len(sets))
		if _, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, k := range sets {
				members[i] = p.SMembers(ctx, k)
			}
			return nil
		}); err != nil {
			return err
		}
		var tags []string
		for _, m := range members {
			tags = append(tags, m.Val()...)
		}
		slices.Sort(tags)
		tags = slices.Compact(tags)
		cmds := make([]*redis.IntCmd, len(tags))
		_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, tag := range tags {
				cmds[i] = p.Del(ctx, s.valueKey(tag))
			}
			p.Del(ctx, sets...)
			p.Publish(ctx, s.channel, fleetevent.Format(fleetevent.URLInvalidated, urlKey))
			return nil
		})
		for _, c := range cmds {
			n += int(c.Val())
		}
		return err
	})
	if err != nil {
		return localN, err
	}
	return max(n, localN), nil
}

// Stats implements dedup.Store: the local tier's size (Redis memory is the
// operator's Redis to watch).
func (s *Cache) Stats() dedup.StoreStats {
	st := s.local.Stats()
	st.Kind = "redis+memory"
	return st
}

// The cache's events: "d <tag>" a flight ended, "i <tag>" a key was
// invalidated, "u <urlkey>" a URL was invalidated.

func (s *Cache) flightEnded(tag string) { s.waiters.Wake(tag) }

func (s *Cache) invalidated(tag string) {
	key := fullKey(tag)
	s.forget(key)
	s.hooks.Invalidated(dedup.Invalidation{Key: key})
}

// forget drops this process's copy of key.
func (s *Cache) forget(key string) {
	_ = s.local.Delete(context.Background(), key)
	s.marks.Invalidate(key)
}

func (s *Cache) invalidatedURL(urlKey string) {
	_, _ = s.local.DeleteURL(context.Background(), urlKey)
	s.hooks.Invalidated(dedup.Invalidation{URLKey: urlKey})
}
