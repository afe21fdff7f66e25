// Package fingerprint owns the vocabulary of client fingerprints: what a
// client's TLS ClientHello, its HTTP/2 connection preface and the header
// order of its requests look like on the wire, the standard fingerprint
// formats computed from them (JA4 and JA3 for TLS, the Akamai string for
// HTTP/2), and a stable identity ([ID]) that connection pools key on.
//
// Everything here is pure parsing of bytes a server read from a client; no
// I/O. Capturing those bytes on a live connection is package capture;
// replaying them towards an origin is upstream/mirror.
//
// # What is kept
//
//   - [ClientHello]: the hello exactly as sent (one TLS record, even when
//     the client split it over several), with its fields decoded. GREASE
//     values stay where they were: the mirror re-randomizes them in place.
//   - [H2]: the client's first SETTINGS (ids, values, order), its first
//     connection-level WINDOW_UPDATE, the PRIORITY frames sent before the
//     first request, and that request's pseudo-header order and priority.
//   - [Shape]: one request's header names in wire order (with their case on
//     HTTP/1.x), and on HTTP/2 its pseudo-header order and priority.
//
// A [Fingerprint] pairs a hello with the client's H2 preface (nil for an
// HTTP/1.x client). Its ID hashes what the origin can tell apart: the hello
// with randoms, key shares, GREASE values, SNI and padding normalized and the
// extensions sorted (Chrome shuffles them per connection), plus the Akamai
// string. Two connections of one browser get the same ID; a connection opened
// with one ID never carries the requests of another.
//
// Hostile input never panics: every parser returns an error instead, and the
// fuzz tests hold each parser to a round trip.
package fingerprint
