// Package loadgen generates HTTP load against onceproxy and provides an
// origin server for that load to land on.
//
// [StartOrigin] runs a small HTTP or HTTPS origin (HTTP/1.1 and HTTP/2 when
// TLS) whose bodies are a pure function of the request URI, so a
// deduplicating proxy can be checked for serving the right body for each key,
// and which counts the requests that actually reached it. [Run] sends N
// requests at concurrency C, round-robin over K target URLs, directly or
// through a forward proxy, and returns a [Result] with latency percentiles,
// status and X-Cache counts.
//
// The package is used by cmd/onceload and is meant to be reused by tests and
// benchmarks. It does not know anything about onceproxy's internals: it only
// speaks HTTP to it.
package loadgen
