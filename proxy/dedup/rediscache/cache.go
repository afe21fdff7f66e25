package rediscache

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/singleflight"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// Cache is the fleet-shared cache and flight coordinator: dedup.Store (a
// small in-process tier in front of the Redis values) and dedup.Fleet.
type Cache struct {
	*client
	local *dedup.MemoryStore

	waiters waiterSet
	// fleetWaits counts Joins waiting on another process's flight.
	fleetWaits atomic.Int64
	// gets shares one Redis GET among concurrent lookups of a key: a
	// stampede of N clients on one instance costs one round trip, not N
	// connections out of the pool (whose exhaustion would read as Redis
	// being slow and open the breaker exactly when sharing matters most).
	gets   singleflight.Group
	leases sync.WaitGroup // lease renewals running
}

var (
	_ dedup.Store = (*Cache)(nil)
	_ dedup.Fleet = (*Cache)(nil)
)

func newCache(c *client, local *dedup.MemoryStore) *Cache {
	s := &Cache{client: c, local: local}
	s.waiters.m = make(map[string]map[chan struct{}]struct{})
	return s
}

// Get implements dedup.Store: the local tier, then Redis. While Redis is
// unavailable it answers from the local tier alone.
func (s *Cache) Get(ctx context.Context, key string) (*dedup.Entry, error) {
	if e, err := s.local.Get(ctx, key); err == nil {
		return e, nil
	}
	// The shared GET must not end with whichever caller started it.
	ch := s.gets.DoChan(key, func() (any, error) {
		return s.getRemote(context.WithoutCancel(ctx), key)
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

// getRemote reads key's value from Redis into the local tier.
func (s *Cache) getRemote(ctx context.Context, key string) (*dedup.Entry, error) {
	var blob []byte
	err := s.exec(ctx, func(ctx context.Context) error {
		var err error
		blob, err = s.rdb.Get(ctx, s.valueKey(tagOf(key))).Bytes()
		return err
	})
	if err != nil {
		// Absent, or Redis away: both are a miss here; the breaker logs
		// the outage once instead of every request.
		return nil, dedup.ErrNotFound
	}
	e, err := decode(blob)
	if err != nil || !time.Now().Before(e.ExpiresAt) {
		return nil, dedup.ErrNotFound
	}
	s.putLocal(key, e)
	return e, nil
}

// putLocal keeps e in the local tier for at most LocalTTL and never past
// its Redis expiry: an invalidation whose message was lost is bounded by
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

// Set implements dedup.Store (used when a flight had no fleet lease):
// the local tier always, Redis when available. A value over
// max_value_bytes stays local.
func (s *Cache) Set(ctx context.Context, key string, e *dedup.Entry, ttl time.Duration) error {
	if ttl <= 0 {
		return nil
	}
	e = e.Expiring(ttl)
	s.putLocal(key, e)
	blob := encode(e)
	if int64(len(blob)) > int64(s.cfg.MaxValueBytes) {
		return nil
	}
	err := s.exec(ctx, func(ctx context.Context) error {
		_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Set(ctx, s.valueKey(tagOf(key)), blob, ttl)
			s.index(ctx, p, e.URLKey, key, ttl)
			return nil
		})
		return err
	})
	if errors.Is(err, dedup.ErrUnavailable) {
		return nil // degraded: kept locally, the breaker already said so
	}
	return err
}

// index records key under its URL so invalidation by URL finds every
// variant. The set lives in the URL's own slot (not the key's): it is
// written next to the value, not in the same script.
func (s *Cache) index(ctx context.Context, p redis.Pipeliner, urlKey, key string, ttl time.Duration) {
	if urlKey == "" {
		return
	}
	ik := s.urlKey(urlKey)
	p.SAdd(ctx, ik, tagOf(key))
	// The set outlives each member's value a little; stale members only
	// cost a DEL of a missing key at invalidation time.
	p.PExpire(ctx, ik, ttl+time.Minute)
}

// Delete implements dedup.Store, fleet-wide: the value in Redis, and every
// process's local tier through an event.
func (s *Cache) Delete(ctx context.Context, key string) error {
	_ = s.local.Delete(ctx, key)
	tag := tagOf(key)
	return s.exec(ctx, func(ctx context.Context) error {
		_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Del(ctx, s.valueKey(tag))
			p.Publish(ctx, s.channel, "i "+tag)
			return nil
		})
		return err
	})
}

// DeleteURL implements dedup.Store, fleet-wide.
func (s *Cache) DeleteURL(ctx context.Context, urlKey string) (int, error) {
	localN, _ := s.local.DeleteURL(ctx, urlKey)
	n := 0
	err := s.exec(ctx, func(ctx context.Context) error {
		tags, err := s.rdb.SMembers(ctx, s.urlKey(urlKey)).Result()
		if err != nil {
			return err
		}
		cmds := make([]*redis.IntCmd, len(tags))
		_, err = s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, tag := range tags {
				cmds[i] = p.Del(ctx, s.valueKey(tag))
			}
			p.Del(ctx, s.urlKey(urlKey))
			p.Publish(ctx, s.channel, "u "+urlKey)
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

func (s *Cache) flightEnded(tag string) { s.waiters.wake(tag) }

func (s *Cache) invalidated(tag string) { _ = s.local.Delete(context.Background(), fullKey(tag)) }

func (s *Cache) invalidatedURL(urlKey string) {
	_, _ = s.local.DeleteURL(context.Background(), urlKey)
}
