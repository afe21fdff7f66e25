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
//   - buffered bodies are bounded by max_body_bytes; larger responses stream
//     to their own client uncached.
package dedup
