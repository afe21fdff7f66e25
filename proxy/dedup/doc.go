// Package dedup makes one logical request go upstream once.
//
// Every request gets a canonical key (Keyer). A request whose key is cached
// is answered from the Store (X-Cache: HIT); one whose key is already being
// fetched waits for that fetch, a flight, and gets its own copy of the
// result (COALESCED); the first one leads the flight (MISS). Rules decide
// what is keyed, what is deduplicated at all (BYPASS otherwise) and what may
// be cached. The Engine is an http.RoundTripper in front of the upstream.
//
// Invariants this package keeps:
//   - one flight per key at a time in this process;
//   - a response is never shared across different credentials unless a rule
//     says so (credentials are part of the key);
//   - each waiter gets its own header map and body reader;
//   - the leader's fetch runs detached from its client, with its own
//     deadline (flight_timeout);
//   - 429 and 5xx are never cached; a failed flight answers its waiters and
//     the next request starts a fresh one;
//   - a flight's body streams to every reader as it arrives, each at its own
//     pace, through a spool (memory up to max_body_bytes, then a file); a
//     body cut short by the origin is an error for every reader and is
//     never cached;
//   - memory and disk are bounded: max_body_bytes per spool and
//     spool_memory_bytes for all, spool_disk_bytes for the spools' files,
//     the Store's own bound, disk.max_bytes for
//     the disk tier (bodies over max_body_bytes, up to max_object_bytes);
//     bigger bodies stream to their own client uncached.
//
// Files: engine.go (the request path and the flight's first half, lead),
// flight.go (the registry of flights and who waits on them), download.go
// (the flight's second half: the body into the spool, then the cache),
// spool.go, disk.go (the disk tier), stream.go and ranges.go (responses
// from spools and files, Range), peer.go (bodies too big for the shared
// store, served to the fleet's other instances and read from them, and
// finished from the origin when a peer fails), peerclient.go (the client
// that reads them).
package dedup
