package dedup

import (
	"context"
	"errors"
	"time"
)

// ErrUnavailable means the shared (fleet) layer cannot be used right now:
// Redis is down or its circuit breaker is open. The engine carries on with
// this process's cache and flights alone and labels upstream fetches BYPASS.
var ErrUnavailable = errors.New("dedup: shared layer unavailable")

// Fleet coordinates flights between onceproxy processes that share a store,
// so a duplicate landing on another process does not go upstream either.
// It is consulted by a process's local flight leader only: the local
// single-flight makes each process one contender.
type Fleet interface {
	// Join joins the fleet-wide flight for key. Exactly one of the results
	// is set:
	//   - lease: this process fetches, then calls lease.Finish;
	//   - out: the flight this process waited on (or the cached value
	//     found while joining) produced this outcome;
	//   - err: no fleet answer (ErrUnavailable, or ctx ended): fetch alone.
	Join(ctx context.Context, key string) (lease Lease, out *Outcome, err error)
}

// Lease is the right, and the duty, to fetch key for the whole fleet.
type Lease interface {
	// Finish publishes the outcome to the waiters of every process and
	// releases the flight. A ttl > 0 also stores out.Entry as the cached
	// value (in the local tier too). Finish must be called once; it never
	// blocks longer than the store's timeouts.
	Finish(ctx context.Context, out Outcome, ttl time.Duration) error
	// Release gives up the flight without an outcome (a recovered panic):
	// waiters elsewhere take over when they notice. A no-op after Finish.
	Release()
}

// Outcome is what a flight produced, as shared between processes.
type Outcome struct {
	// Entry is the response; nil when the fetch failed without one.
	Entry *Entry
	// Err describes a fetch that produced no response (connection refused,
	// timeout); the waiters answer 502, or 504 when Timeout is set.
	Err     string
	Timeout bool
	// Cached is set when Join found the value already stored.
	Cached bool
	// Peer, on a TooLarge outcome, names the instance that downloads the
	// body and serves it from its peer listener (Engine.PeerHandler) while
	// it does, and from its cache after. An engine with Options.Peers
	// reads it from there; one without fetches its own copy. Shared stores
	// carry it with the leader's lease, never in the stored outcome, so
	// that instances of older versions read the outcome they know.
	Peer *Peer
}

// TooLarge is the outcome a flight shares when its response is too big to
// go through the shared store: its waiters read the body from peer, or,
// with none, fetch their own copy.
func TooLarge(peer *Peer) Outcome { return Outcome{Err: errTooLarge, Peer: peer} }

// IsTooLarge reports whether o is a TooLarge outcome.
func (o *Outcome) IsTooLarge() bool { return o.Entry == nil && o.Err == errTooLarge }

// A StreamingLease is a Lease whose fleet can send the flight's waiters to
// this instance's peer listener for a body too big for the shared store,
// instead of telling them to fetch their own copy: the lease is then held
// for the whole download, so that instances joining meanwhile are sent
// there too, and the fleet downloads the body once.
type StreamingLease interface {
	Lease
	// StreamAbove is the body size above which the fleet would rather its
	// waiters read the body from this instance than receive it through
	// the store (the store's value limit); 0: it cannot (no peer address
	// advertised).
	StreamAbove() int64
	// Stream tells the flight's waiters everywhere that the body comes
	// from this instance (TooLarge with this instance as Peer). After it
	// succeeds the lease stays held until Finish or Release, which the
	// engine calls at the end of the download; Finish then shares the
	// entry only if the store can hold it, and TooLarge otherwise.
	Stream(ctx context.Context) error
}

// Peer is an instance of the fleet that serves the bodies it holds.
type Peer struct {
	Instance string // its instance ID
	Addr     string // host:port of its peer listener
}

// remoteError is a failure reported by another process's flight.
type remoteError struct {
	msg     string
	timeout bool
}

func (e *remoteError) Error() string { return e.msg + " (fetched by another onceproxy instance)" }
func (e *remoteError) Timeout() bool { return e.timeout }

// Recorder receives every request outcome, for fleet-wide statistics.
type Recorder interface {
	// Record counts one response with its X-Cache value; avoided is the
	// body bytes it saved (HIT, COALESCED) and moneyNano the money, in
	// billionths of the savings currency.
	Record(xcache string, avoided int, moneyNano int64)
}

// KeyPrefix starts every key the engine makes ("v1:"): stores that split
// the hash off for their own naming put it back with it.
const KeyPrefix = keyVersion + ":"
