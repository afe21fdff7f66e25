package dedup

import (
	"context"
	"net/http"
	"sync"
	"time"
)

// A flight is one upstream fetch and every request that wants its result:
// the one that started it (the leader) and those that joined. It stays in
// the registry from the first request until its body has arrived (or
// failed), not just until its headers: a request that comes in the middle
// of a download joins it and reads the body from byte 0.
type flight struct {
	key   string
	ready chan struct{} // closed once res is set
	res   *flightResult

	// Guarded by flights.mu.
	interest   int  // requests waiting for res or reading the body
	listed     bool // in the registry: new requests for key join it
	held       bool // the flight holds res.obj's spool (until unlisted and nobody is interested)
	leaderGone bool // the leader left before res was set
}

// flightResult is what a flight hands to everyone who waited on it.
type flightResult struct {
	// entry is a whole response: found in the cache by the leader, or
	// fetched by another instance.
	entry *Entry
	// obj is the response this flight fetched: headers known, body
	// streaming into its spool.
	obj *object
	// stream is a response larger than max_object_bytes: only the
	// leader's client gets it.
	stream *http.Response
	err    error
	// fetchOwn: the response cannot be shared (too large, fetched by
	// another process): every waiter fetches its own copy.
	fetchOwn bool
	// label is the leader's X-Cache: MISS when it went upstream, HIT when it
	// found the response cached after winning, COALESCED when another
	// process fetched it, BYPASS when it fetched without the shared layer.
	label string
	// end is the fleet's lease of a flight that fetched entry, a response
	// to cache, still to finish: fly finishes it once the local waiters
	// have the result, and the flight stays listed until then. Never
	// changed after publish.
	end leaseEnd
}

// leaseEnd is what a flight still has to tell the fleet: its entry, to
// keep for ttl from its headers (keepEntry).
type leaseEnd struct {
	lease Lease // nil: nothing
	ttl   time.Duration
	slots func() // gives back the flight's max_flights slots
}

// meta is the response's status and headers, whatever carries them.
func (r *flightResult) meta() *Entry {
	switch {
	case r.entry != nil:
		return r.entry
	case r.obj != nil:
		return r.obj.meta
	}
	return nil
}

// object is the response a flight fetched: its status and headers, and
// its body as it arrives.
type object struct {
	meta *Entry // Body nil; ExpiresAt set when the body will be cached
	size int64  // declared length; -1 unknown
	body *spool
	// keep: the body is to be cached when complete. A body nobody keeps
	// is not worth finishing once nobody reads it.
	keep bool
	// owed: the flight's fleet lease waits for the body (it goes to the
	// other instances' waiters whole, when complete), so the download
	// goes on with nobody reading it here. Guarded by flights.mu.
	owed   bool
	cancel context.CancelCauseFunc // stops the download
}

// unwanted reports whether nobody needs the rest of the body: it is not to
// be kept, nor owed to the fleet. flights.mu is held.
func (o *object) unwanted() bool { return !o.keep && !o.owed }

// flights is the registry of running flights.
type flights struct {
	// mu protects m and the flights' guarded fields. It is never held
	// while calling into a spool: a spool in relay mode asks for a
	// flight's interest with its own lock held.
	mu sync.Mutex
	m  map[string]*flight
}

// join returns the flight for key and counts the caller's interest in it.
// With no flight running it creates one, and the caller leads it.
func (fs *flights) join(key string) (f *flight, leader bool) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if f = fs.m[key]; f == nil {
		f = &flight{key: key, ready: make(chan struct{}), listed: true}
		fs.m[key] = f
		leader = true
	}
	f.interest++
	return f, leader
}

// attach is join without starting a flight: nil when none runs for key.
func (fs *flights) attach(key string) *flight {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	f := fs.m[key]
	if f != nil {
		f.interest++
	}
	return f
}

// publish sets f's result and wakes its waiters. A result without a body
// to stream ends the flight, or once its lease has ended when it has one
// to end (unlist): later requests start a new one.
func (fs *flights) publish(f *flight, res *flightResult) {
	fs.mu.Lock()
	f.res = res
	var stop, drop bool
	switch {
	case res.obj != nil:
		f.held = true
		stop = f.interest == 0 && res.obj.unwanted()
	case res.stream != nil && f.leaderGone:
		drop = true
	}
	if res.obj == nil && res.end.lease == nil || stop {
		fs.unlistLocked(f)
	}
	release := fs.releasableLocked(f)
	fs.mu.Unlock()
	close(f.ready)
	if stop {
		res.obj.cancel(errNoReaders)
	}
	if drop {
		// Nobody will read the leader's oversized stream.
		res.stream.Body.Close()
	}
	if release {
		res.obj.body.release()
	}
}

// leave drops one request's interest in f and returns f's result (nil
// while it has none). The download of a body nobody keeps stops when the
// last reader leaves.
func (fs *flights) leave(f *flight, leader bool) *flightResult {
	fs.mu.Lock()
	f.interest--
	res := f.res
	if res == nil && leader {
		f.leaderGone = true
	}
	stop := res != nil && res.obj != nil && res.obj.unwanted() && f.interest == 0 && f.listed
	if stop {
		fs.unlistLocked(f)
	}
	release := fs.releasableLocked(f)
	fs.mu.Unlock()
	if stop {
		res.obj.cancel(errNoReaders)
	}
	if res != nil && res.obj != nil {
		res.obj.body.poke()
	}
	if release {
		res.obj.body.release()
	}
	return res
}

// interestIn counts the requests interested in f.
func (fs *flights) interestIn(f *flight) int {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return f.interest
}

// unlist takes f out of the registry (its body is complete, failed, or no
// longer kept): new requests for its key start a new flight.
func (fs *flights) unlist(f *flight) {
	fs.mu.Lock()
	fs.unlistLocked(f)
	release := fs.releasableLocked(f)
	fs.mu.Unlock()
	if release {
		f.res.obj.body.release()
	}
}

func (fs *flights) unlistLocked(f *flight) {
	if f.listed && fs.m[f.key] == f {
		delete(fs.m, f.key)
	}
	f.listed = false
}

// releasableLocked reports, once, that f's hold on its spool can go:
// nobody can join it any more and nobody waits on it. Readers hold the
// spool themselves.
func (fs *flights) releasableLocked(f *flight) bool {
	if !f.held || f.listed || f.interest > 0 {
		return false
	}
	f.held = false
	return true
}

// running counts the flights in the registry.
func (fs *flights) running() int {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return len(fs.m)
}

// drop stops keeping f's body (it grew past max_object_bytes): f leaves
// the registry, and its download stops when its last reader leaves.
func (fs *flights) drop(f *flight) { fs.stopKeeping(f, true) }

// unkeep marks f's body as one nobody will keep (it outgrew every tier,
// or outlived its TTL while it came), leaving f listed for requests that
// join it: the download then stops when its last reader leaves.
func (fs *flights) unkeep(f *flight) { fs.stopKeeping(f, false) }

// stopKeeping marks f's body as one nobody keeps, unlisting f at once when
// unlist is set. The download stops now if nobody reads it.
func (fs *flights) stopKeeping(f *flight, unlist bool) {
	fs.mu.Lock()
	obj := f.res.obj
	obj.keep = false
	stop := f.interest == 0 && !obj.owed && (unlist || f.listed)
	if unlist || stop {
		fs.unlistLocked(f)
	}
	release := fs.releasableLocked(f)
	fs.mu.Unlock()
	if stop {
		obj.cancel(errNoReaders)
	}
	if release {
		obj.body.release()
	}
}
