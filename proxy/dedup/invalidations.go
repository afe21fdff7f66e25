package dedup

import (
	"sync"
	"time"
)

// Invalidation is one invalidation made elsewhere in the fleet: of one
// key, or (URLKey) of every variant of a URL.
type Invalidation struct {
	Key    string
	URLKey string
}

// InvalidationSource is a Store that hears of invalidations made by other
// processes (a fleet's shared store, through its events). The engine
// listens to it for its disk tier, which holds bodies too big for the
// store that only this process has: without it, an invalidation made on
// another instance left them served as HITs for their whole TTL.
type InvalidationSource interface {
	// OnInvalidated calls f for each invalidation heard from now until
	// stop is called. f must not block: it runs on the store's event
	// loop.
	OnInvalidated(f func(Invalidation)) (stop func())
}

// InvalidationHooks implements InvalidationSource for a store: it calls
// Invalidated for each invalidation its events bring. The zero value is
// ready to use.
type InvalidationHooks struct {
	mu    sync.Mutex
	next  int
	hooks map[int]func(Invalidation)
}

// OnInvalidated implements InvalidationSource.
func (h *InvalidationHooks) OnInvalidated(f func(Invalidation)) (stop func()) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.hooks == nil {
		h.hooks = map[int]func(Invalidation){}
	}
	id := h.next
	h.next++
	h.hooks[id] = f
	return func() {
		h.mu.Lock()
		delete(h.hooks, id)
		h.mu.Unlock()
	}
}

// Invalidated tells every registered hook of inv. The lock is held while
// they run, so that none runs after its stop has returned (the engine
// closes its disk tier right after).
func (h *InvalidationHooks) Invalidated(inv Invalidation) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, f := range h.hooks {
		f(inv)
	}
}

// invalidationLog remembers the invalidations of the last while, so that
// a flight whose response arrived before one of them does not cache it
// when it ends after it: an invalidation says that what the origin served
// until then is not to be served any more, and a body still downloading
// when it came (a big file takes minutes) was fetched before it. The
// flight's own clients, who asked before the invalidation, still get it.
//
// Bounded by count and age; what it forgets it forgets conservatively:
// past a forgotten invalidation (lost), nothing fetched before its time is
// cached, whatever its URL. That costs only flights that outlive
// invalidationMemory or a burst of maxInvalidations.
type invalidationLog struct {
	mu    sync.Mutex
	at    map[string]time.Time // "k"+key or "u"+urlKey → the newest invalidation's time
	queue []loggedInvalidation // in the order added, for forgetting
	lost  time.Time            // the newest time forgotten
}

type loggedInvalidation struct {
	id string
	at time.Time
}

const (
	// invalidationMemory is how long an invalidation is remembered: far
	// past flight_timeout's default, and most downloads.
	invalidationMemory = time.Hour
	// maxInvalidations bounds what is remembered (a script invalidating
	// URL after URL).
	maxInvalidations = 16384
)

func invalidationIDs(inv Invalidation) []string {
	var ids []string
	if inv.Key != "" {
		ids = append(ids, "k"+inv.Key)
	}
	if inv.URLKey != "" {
		ids = append(ids, "u"+inv.URLKey)
	}
	return ids
}

// add records inv as made at now.
func (l *invalidationLog) add(inv Invalidation, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.at == nil {
		l.at = map[string]time.Time{}
	}
	for _, id := range invalidationIDs(inv) {
		l.at[id] = now
		l.queue = append(l.queue, loggedInvalidation{id, now})
	}
	n := 0
	for n < len(l.queue) && (len(l.queue)-n > maxInvalidations || now.Sub(l.queue[n].at) > invalidationMemory) {
		old := l.queue[n]
		if old.at.After(l.lost) {
			l.lost = old.at
		}
		if l.at[old.id].Equal(old.at) {
			delete(l.at, old.id)
		}
		n++
	}
	if n > 0 {
		l.queue = append(l.queue[:0], l.queue[n:]...)
	}
}

// since reports whether key or urlKey was invalidated at or after t, or
// may have been (forgotten since).
func (l *invalidationLog) since(key, urlKey string, t time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.queue == nil {
		return false // nothing ever invalidated: the common case, at once
	}
	if !t.After(l.lost) {
		return true
	}
	for _, id := range invalidationIDs(Invalidation{Key: key, URLKey: urlKey}) {
		if at, ok := l.at[id]; ok && !at.Before(t) {
			return true
		}
	}
	return false
}
