package dedup

import (
	"context"
	"math"
	"sync/atomic"
	"time"

	"github.com/maypok86/otter/v2"
)

// MemoryStore is a Store in process memory, bounded by the total size of
// the stored responses, with a TTL per entry. Eviction is otter's
// (W-TinyLFU): hot keys survive churn from one-off URLs.
type MemoryStore struct {
	c         *otter.Cache[string, *Entry]
	maxBytes  int64
	evictions atomic.Uint64
}

// NewMemoryStore returns a store holding at most maxBytes of responses.
func NewMemoryStore(maxBytes int64) *MemoryStore {
	s := &MemoryStore{maxBytes: maxBytes}
	s.c = otter.Must(&otter.Options[string, *Entry]{
		MaximumWeight: uint64(maxBytes),
		Weigher: func(_ string, e *Entry) uint32 {
			return uint32(min(e.size(), math.MaxUint32))
		},
		ExpiryCalculator: otter.ExpiryWritingFunc(func(e otter.Entry[string, *Entry]) time.Duration {
			return time.Until(e.Value.ExpiresAt)
		}),
		OnDeletion: func(e otter.DeletionEvent[string, *Entry]) {
			if e.Cause == otter.CauseOverflow {
				s.evictions.Add(1)
			}
		},
	})
	return s
}

// Get implements Store.
func (s *MemoryStore) Get(_ context.Context, key string) (*Entry, error) {
	e, ok := s.c.GetIfPresent(key)
	if !ok || !time.Now().Before(e.ExpiresAt) {
		return nil, ErrNotFound
	}
	return e, nil
}

// Set implements Store. The entry expires at e.ExpiresAt when set, else
// after ttl.
func (s *MemoryStore) Set(_ context.Context, key string, e *Entry, ttl time.Duration) error {
	if ttl <= 0 {
		return nil
	}
	s.c.Set(key, e.Expiring(ttl))
	return nil
}

// Delete implements Store.
func (s *MemoryStore) Delete(_ context.Context, key string) error {
	s.c.Invalidate(key)
	return nil
}

// DeleteURL implements Store. It walks the whole cache: an admin action,
// not a hot path, and cheaper than keeping a second index consistent with
// otter's evictions.
func (s *MemoryStore) DeleteURL(_ context.Context, urlKey string) (int, error) {
	var victims []string
	for k, e := range s.c.All() {
		if e.URLKey == urlKey {
			victims = append(victims, k)
		}
	}
	n := 0
	for _, k := range victims {
		if _, ok := s.c.Invalidate(k); ok {
			n++
		}
	}
	return n, nil
}

// Stats implements Store.
func (s *MemoryStore) Stats() StoreStats {
	return StoreStats{
		Kind:      "memory",
		Entries:   s.c.EstimatedSize(),
		Bytes:     int64(s.c.WeightedSize()),
		MaxBytes:  s.maxBytes,
		Evictions: s.evictions.Load(),
	}
}

// Close stops the store's background maintenance.
func (s *MemoryStore) Close() { s.c.StopAllGoroutines() }
