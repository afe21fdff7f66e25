package dedup

import "sync"

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
