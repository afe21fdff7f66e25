package pgstore

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"golang.org/x/sync/singleflight"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/fleetevent"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/storecodec"
)

// Cache is the fleet-shared cache and flight coordinator: dedup.Store and
// dedup.TieredStore (a small in-process tier in front of the database's
// values) and dedup.Fleet. With both, the engine reads only the memory
// tier before a flight, and Join reads the table in the same round trip
// that takes the lock.
type Cache struct {
	*client
	local *dedup.MemoryStore

	waiters fleetevent.Waiters
	// fleetWaits counts Joins waiting on another process's flight.
	fleetWaits atomic.Int64
	// unlocked counts flights led without a lock (flight_locks taken, or
	// the server's lock table full); lastUnlockedLog rate-limits the
	// warning.
	unlocked        atomic.Int64
	lastUnlockedLog atomic.Int64
	// gets shares one SELECT among concurrent lookups of a key: a
	// stampede on one instance costs one round trip, not a pool's worth.
	gets singleflight.Group
	// pending holds what was cached while the database was away.
	pending pendingSet
	// peer is the address of this instance's peer listener, named by
	// the flights it leads (AdvertisePeer); nil or "": none.
	peer atomic.Pointer[string]
	// dropping holds the rows too big to read being deleted (dropTooBig):
	// one delete per row, however many readers find it meanwhile.
	dropping sync.Map
	// hooks hear the invalidations other instances make (the engine's
	// disk tier, which this cache does not hold).
	hooks dedup.InvalidationHooks
}

var (
	_ dedup.TieredStore        = (*Cache)(nil)
	_ dedup.Fleet              = (*Cache)(nil)
	_ dedup.InvalidationSource = (*Cache)(nil)
)

// OnInvalidated implements dedup.InvalidationSource.
func (s *Cache) OnInvalidated(f func(dedup.Invalidation)) (stop func()) {
	return s.hooks.OnInvalidated(f)
}

func newCache(c *client, local *dedup.MemoryStore) *Cache {
	s := &Cache{client: c, local: local}
	s.pending.m = make(map[string]struct{})
	// Back from an outage: let every waiter re-check at once.
	c.onReconnect(s.waiters.WakeAll)
	return s
}

// maxBody bounds what a stored value may inflate to.
func (s *Cache) maxBody() int64 { return storecodec.BodyLimit(int64(s.cfg.MaxValueBytes)) }

// shareable is storecodec.Shareable at max_value_bytes.
func (s *Cache) shareable(e *dedup.Entry, value []byte) bool {
	return storecodec.Shareable(e, value, int64(s.cfg.MaxValueBytes))
}

// GetLocal implements dedup.TieredStore: what the memory tier may answer
// without the database. A copy of a shared value is kept there for
// local_ttl at most, so whatever it holds answers, but for a copy cached
// during an outage and not shared yet while the database is back: the
// fleet may have stored a newer one, which Get compares it with.
func (s *Cache) GetLocal(ctx context.Context, key string) (*dedup.Entry, error) {
	e, err := s.local.Get(ctx, key)
	if err != nil {
		return nil, dedup.ErrNotFound
	}
	if s.pending.has(key) && s.available() {
		return s.Get(ctx, key)
	}
	return e, nil
}

// Get implements dedup.Store: the local tier, then the database. While the
// database is unavailable it answers from the local tier alone.
func (s *Cache) Get(ctx context.Context, key string) (*dedup.Entry, error) {
	if e, err := s.local.Get(ctx, key); err == nil {
		if !s.pending.has(key) || !s.available() {
			return e, nil
		}
		// Cached while the database was away, not shared yet: a newer
		// value another instance stored meanwhile wins.
		if r, err := s.readShared(ctx, key); err == nil && r.StoredAt.After(e.StoredAt) {
			s.pending.remove(key)
			s.putLocal(key, r)
			return r, nil
		}
		return e, nil
	}
	if !s.available() {
		return nil, dedup.ErrNotFound
	}
	// The shared SELECT must not end with whichever caller started it.
	ch := s.gets.DoChan(key, func() (any, error) {
		e, err := s.readShared(context.WithoutCancel(ctx), key)
		if err != nil {
			return nil, err
		}
		s.putLocal(key, e)
		return e, nil
	})
	select {
	case r := <-ch:
		if r.Err != nil {
			return nil, r.Err
		}
		return r.Val.(*dedup.Entry), nil
	case <-ctx.Done():
		return nil, dedup.ErrNotFound
	}
}

// readShared reads key's value from the database. Absent, unreadable or
// the database away: all are a miss here (the breaker logs an outage once
// instead of every request).
func (s *Cache) readShared(ctx context.Context, key string) (*dedup.Entry, error) {
	if !storable(key) {
		return nil, dedup.ErrNotFound
	}
	var blob []byte
	var size int32
	err := s.exec(ctx, func(ctx context.Context) error {
		return s.pool.QueryRow(ctx, s.sql.get, key, int64(s.cfg.MaxValueBytes)).Scan(&blob, &size)
	})
	if err != nil {
		return nil, dedup.ErrNotFound
	}
	if s.tooBig(size) {
		s.dropTooBig(key, size, s.sql.dropBigValue, "cached value")
		return nil, dedup.ErrNotFound
	}
	e, ok := s.decodeValue(ctx, key, blob)
	if !ok {
		return nil, dedup.ErrNotFound
	}
	return e, nil
}

// decodeValue reads a stored value. One this build cannot read (another
// version, corrupt bytes) is counted, removed unless replaced meanwhile,
// and reported as absent; one past its expiry in this process's clock is
// absent too.
func (s *Cache) decodeValue(ctx context.Context, key string, blob []byte) (*dedup.Entry, bool) {
	e, err := storecodec.DecodeLimit(blob, s.maxBody())
	if err != nil {
		s.rejected.Add(1)
		s.log.Debug("postgres: ignored a cached value it cannot read", "key", key, "err", err)
		sum := md5.Sum(blob)
		_ = s.exec(ctx, func(ctx context.Context) error {
			_, err := s.pool.Exec(ctx, s.sql.dropValue, key, hex.EncodeToString(sum[:]))
			return err
		})
		return nil, false
	}
	if !time.Now().Before(e.ExpiresAt) {
		return nil, false
	}
	return e, true
}

// putLocal keeps e in the local tier for at most LocalTTL and never past
// its expiry: an invalidation whose notification was lost is bounded by
// LocalTTL.
func (s *Cache) putLocal(key string, e *dedup.Entry) {
	c := *e
	if limit := time.Now().Add(s.cfg.LocalTTL); c.ExpiresAt.After(limit) {
		c.ExpiresAt = limit
	}
	if ttl := time.Until(c.ExpiresAt); ttl > 0 {
		_ = s.local.Set(context.Background(), key, &c, ttl)
	}
}

// keepLocal keeps e in the local tier for its whole TTL: the database is
// away, so the memory store is the cache. It is shared when the database
// is back (resync).
func (s *Cache) keepLocal(key string, e *dedup.Entry) {
	if ttl := time.Until(e.ExpiresAt); ttl > 0 {
		_ = s.local.Set(context.Background(), key, e, ttl)
		if !s.pending.add(key) {
			s.log.Debug("postgres: too many values cached during the outage to share them all later", "key", key)
		}
	}
}

// Set implements dedup.Store (used when a flight had no fleet lease): the
// database when available, and the local tier always. A value over
// max_value_bytes is cached by this instance only.
func (s *Cache) Set(ctx context.Context, key string, e *dedup.Entry, ttl time.Duration) error {
	if ttl <= 0 {
		return nil
	}
	e = e.Expiring(ttl)
	blob := storecodec.Encode(e)
	if !s.shareable(e, blob) || !storable(key) || !storable(e.URLKey) {
		_ = s.local.Set(ctx, key, e, ttl)
		return nil
	}
	if !s.available() {
		s.keepLocal(key, e)
		return nil
	}
	err := s.exec(ctx, func(ctx context.Context) error {
		_, err := s.pool.Exec(ctx, s.sql.set, key, e.URLKey, blob, e.StoredAt, ttl.Milliseconds(), s.channel, fleetevent.Format(fleetevent.FlightEnded, key))
		return err
	})
	if err != nil {
		s.keepLocal(key, e)
		if errors.Is(err, dedup.ErrUnavailable) {
			return nil // degraded: kept locally, the breaker already said so
		}
		return err
	}
	s.putLocal(key, e)
	return nil
}

// Delete implements dedup.Store, fleet-wide: the row, and every process's
// local tier through a notification.
func (s *Cache) Delete(ctx context.Context, key string) error {
	_ = s.local.Delete(ctx, key)
	s.pending.remove(key)
	if !storable(key) {
		return nil
	}
	return s.exec(ctx, func(ctx context.Context) error {
		_, err := s.pool.Exec(ctx, s.sql.del, key, s.channel, fleetevent.Format(fleetevent.Invalidated, key))
		return err
	})
}

// DeleteURL implements dedup.Store, fleet-wide.
func (s *Cache) DeleteURL(ctx context.Context, urlKey string) (int, error) {
	localN, _ := s.local.DeleteURL(ctx, urlKey)
	if !storable(urlKey) || urlKey == "" {
		return localN, nil
	}
	var n int64
	err := s.exec(ctx, func(ctx context.Context) error {
		return s.pool.QueryRow(ctx, s.sql.delURL, urlKey, s.channel, fleetevent.Format(fleetevent.URLInvalidated, urlKey)).Scan(&n)
	})
	if err != nil {
		return localN, err
	}
	return max(int(n), localN), nil
}

// Stats implements dedup.Store: the local tier's size (the table is the
// operator's database to watch).
func (s *Cache) Stats() dedup.StoreStats {
	st := s.local.Stats()
	st.Kind = "postgres+memory"
	return st
}

// share runs resync whenever the database is available and something
// cached during an outage is not shared yet, until ctx ends.
func (s *Cache) share(ctx context.Context) {
	t := time.NewTicker(s.probeEvery())
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if s.available() && s.pending.len() > 0 {
				s.resync(ctx)
			}
		}
	}
}

// resync shares what this instance cached while the database was away:
// each value replaces only an older one in the database; where the fleet
// stored a newer one meanwhile, the local copy goes and the next lookup
// reads the fleet's. A failure leaves the rest for the next reconnect.
func (s *Cache) resync(ctx context.Context) {
	for _, key := range s.pending.keys() {
		e, err := s.local.Get(ctx, key)
		if err != nil {
			s.pending.remove(key)
			continue
		}
		ttl := time.Until(e.ExpiresAt)
		if ttl <= 0 {
			s.pending.remove(key)
			continue
		}
		blob := storecodec.Encode(e)
		var won bool
		err = s.exec(ctx, func(ctx context.Context) error {
			return s.pool.QueryRow(ctx, s.sql.resync, key, e.URLKey, blob, e.StoredAt, ttl.Milliseconds(),
				s.channel, fleetevent.FormatReplaced(key, e.StoredAt.UnixMilli())).Scan(&won)
		})
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			// The fleet's value is as new or newer.
			_ = s.local.Delete(ctx, key)
		case err != nil:
			s.log.Debug("postgres: sharing values cached during the outage stopped", "err", err)
			return
		default:
			// Shared, and older copies elsewhere dropped: from now on it
			// is a short-lived copy of the fleet's value like any other.
			s.putLocal(key, e)
		}
		s.pending.remove(key)
	}
}

// The cache's notifications: "d <key>" a flight ended, "i <key>" a key was
// invalidated, "u <urlkey>" a URL was invalidated, "r <key> <ms>" a copy
// cached during an outage replaced an older one.

func (s *Cache) flightEnded(key string) { s.waiters.Wake(key) }

func (s *Cache) invalidated(key string) {
	_ = s.local.Delete(context.Background(), key)
	s.pending.remove(key)
	s.hooks.Invalidated(dedup.Invalidation{Key: key})
}

func (s *Cache) invalidatedURL(urlKey string) {
	_, _ = s.local.DeleteURL(context.Background(), urlKey)
	s.hooks.Invalidated(dedup.Invalidation{URLKey: urlKey})
}

// replaced handles a Replaced message: another instance shared a copy of
// key fetched at ms (Unix milliseconds) after an outage. A local copy
// fetched before it is stale: it goes, and is not shared any more.
func (s *Cache) replaced(key string, ms int64) {
	if e, err := s.local.Get(context.Background(), key); err == nil && e.StoredAt.UnixMilli() < ms {
		_ = s.local.Delete(context.Background(), key)
		s.pending.remove(key)
	}
}

// maxPending bounds the keys remembered for sharing after an outage; the
// values themselves are bounded by the memory store.
const maxPending = 100_000

// pendingSet is the keys cached while the database was away.
type pendingSet struct {
	mu sync.Mutex
	m  map[string]struct{}
}

func (p *pendingSet) add(key string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.m[key]; !ok && len(p.m) >= maxPending {
		return false
	}
	p.m[key] = struct{}{}
	return true
}

func (p *pendingSet) has(key string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.m[key]
	return ok
}

func (p *pendingSet) remove(key string) {
	p.mu.Lock()
	delete(p.m, key)
	p.mu.Unlock()
}

func (p *pendingSet) len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.m)
}

func (p *pendingSet) keys() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]string, 0, len(p.m))
	for k := range p.m {
		out = append(out, k)
	}
	return out
}
