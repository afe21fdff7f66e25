package dedup

import (
	"context"
	"errors"
	"time"
)

// ErrNotFound is returned by Store.Get for a key that is absent or expired.
var ErrNotFound = errors.New("dedup: not in cache")

// Store keeps cached responses under their canonical keys. Implementations
// are safe for concurrent use and never return an entry past its TTL. The
// engine treats every error other than ErrNotFound as "store unavailable":
// the request still goes upstream.
type Store interface {
	// Get returns the entry stored under key, or ErrNotFound. An entry a
	// MemoryStore returns is its caller's alone (the engine lends its
	// header to the response it serves); a Store that shares one read
	// among concurrent callers must not share such an entry.
	Get(ctx context.Context, key string) (*Entry, error)
	// Set stores e under key for ttl. e must not be modified afterwards.
	Set(ctx context.Context, key string, e *Entry, ttl time.Duration) error
	// Delete removes key; removing an absent key is not an error.
	Delete(ctx context.Context, key string) error
	// DeleteURL removes every entry stored with this URL key (all methods,
	// header variants and credentials of one URL) and returns how many.
	DeleteURL(ctx context.Context, urlKey string) (int, error)
	// Stats describes the store's contents.
	Stats() StoreStats
}

// A TieredStore is a Store with a tier in this process in front of a tier
// shared by the fleet: GetLocal reads the first alone, never leaving the
// process. With a Fleet, whose Join answers a value already shared
// (Outcome.Cached) in the same round trip that would otherwise take the
// lease, the engine reads only this process's tier before a flight: a miss
// then costs one round trip to learn "not there, you lead", not a shared
// read first and the join after it.
type TieredStore interface {
	Store
	// GetLocal returns what this process's tier may answer for key
	// without asking the shared one, or ErrNotFound.
	GetLocal(ctx context.Context, key string) (*Entry, error)
}

// StoreStats is a snapshot of a store's size.
type StoreStats struct {
	Kind      string `json:"kind"`
	Entries   int    `json:"entries"`
	Bytes     int64  `json:"bytes"`
	MaxBytes  int64  `json:"max_bytes"`
	Evictions uint64 `json:"evictions"`
}

// EntryLimiter is a Store that cannot hold entries over a size (Redis:
// redis.max_value_bytes). A body bigger than MaxEntryBytes is kept in this
// process's disk tier instead, and the fleet's waiters are told to fetch
// their own copy rather than handed an outcome the store cannot carry.
type EntryLimiter interface {
	MaxEntryBytes() int64
}
