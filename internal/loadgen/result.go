package loadgen

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

// Result is the outcome of a [Run].
type Result struct {
	// Requests is the number of requests that completed, failed ones
	// included. Requests cut short because Run's context ended are not
	// counted.
	Requests int
	// Errors is the number of requests that got no complete response
	// (dial, TLS, proxy, timeout or body read failure). A response with an
	// error status is not an error here; see Status.
	Errors int
	// ErrorSamples holds the first few distinct error messages.
	ErrorSamples []string

	// Duration is the wall time of the whole run.
	Duration time.Duration
	// RPS is Requests divided by Duration.
	RPS float64
	// P50, P90, P99 and Max are nearest-rank percentiles of the time from
	// sending a request to reading the last byte of its body, over
	// successful requests only. They are zero if none succeeded.
	P50, P90, P99, Max time.Duration

	// Status counts responses by status code.
	Status map[int]int
	// XCache counts responses by X-Cache header value; "-" counts
	// responses without one.
	XCache map[string]int
	// Protos counts responses by protocol, such as "HTTP/1.1" or "HTTP/2.0".
	Protos map[string]int
	// BytesRead is the total number of body bytes read.
	BytesRead int64

	// latencies are the successful requests' times, sorted: what Merge
	// recomputes the percentiles of several runs from.
	latencies []time.Duration
}

// Merge adds up runs made one after another (rounds of one measurement):
// their requests, errors, counts, bytes and durations; RPS is the total
// requests over the summed durations, and the percentiles are those of
// every successful request of every run.
func Merge(runs ...*Result) *Result {
	m := &Result{Status: make(map[int]int), XCache: make(map[string]int), Protos: make(map[string]int)}
	n := 0
	for _, r := range runs {
		n += len(r.latencies)
	}
	all := make([]time.Duration, 0, n)
	for _, r := range runs {
		m.Requests += r.Requests
		m.Errors += r.Errors
		m.Duration += r.Duration
		m.BytesRead += r.BytesRead
		for _, s := range r.ErrorSamples {
			m.ErrorSamples = addSample(m.ErrorSamples, s)
		}
		for k, v := range r.Status {
			m.Status[k] += v
		}
		for k, v := range r.XCache {
			m.XCache[k] += v
		}
		for k, v := range r.Protos {
			m.Protos[k] += v
		}
		all = append(all, r.latencies...)
	}
	m.setLatencies(all)
	if m.Duration > 0 {
		m.RPS = float64(m.Requests) / m.Duration.Seconds()
	}
	return m
}

// setLatencies sorts durations and sets the percentile fields from it.
func (r *Result) setLatencies(durations []time.Duration) {
	slices.Sort(durations)
	r.latencies = durations
	r.P50 = percentile(durations, 50)
	r.P90 = percentile(durations, 90)
	r.P99 = percentile(durations, 99)
	if len(durations) > 0 {
		r.Max = durations[len(durations)-1]
	}
}

// percentile returns the nearest-rank p-th percentile of sorted, or 0 if
// sorted is empty.
func percentile(sorted []time.Duration, p int) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := (p*len(sorted) + 99) / 100 // ceil(p/100 * n)
	return sorted[max(rank, 1)-1]
}

// String returns a compact multi-line report.
func (r *Result) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "requests %d in %v (%.1f req/s), %d errors\n",
		r.Requests, r.Duration.Round(time.Millisecond), r.RPS, r.Errors)
	fmt.Fprintf(&b, "latency  p50 %v  p90 %v  p99 %v  max %v\n",
		roundDuration(r.P50), roundDuration(r.P90), roundDuration(r.P99), roundDuration(r.Max))
	fmt.Fprintf(&b, "status   %s\n", counts(r.Status, func(code int) string { return fmt.Sprint(code) }))
	fmt.Fprintf(&b, "x-cache  %s\n", counts(r.XCache, func(s string) string { return s }))
	fmt.Fprintf(&b, "proto    %s\n", counts(r.Protos, func(s string) string { return s }))
	fmt.Fprintf(&b, "read     %s", formatBytes(r.BytesRead))
	for _, s := range r.ErrorSamples {
		fmt.Fprintf(&b, "\nerror    %s", s)
	}
	return b.String()
}

// counts formats m as "k1=v1 k2=v2" in key order, or "none".
func counts[K cmp.Ordered](m map[K]int, name func(K) string) string {
	if len(m) == 0 {
		return "none"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s=%d", name(k), m[k]))
	}
	return strings.Join(parts, " ")
}

// roundDuration keeps about three significant digits.
func roundDuration(d time.Duration) time.Duration {
	switch {
	case d >= time.Second:
		return d.Round(time.Millisecond)
	case d >= 10*time.Millisecond:
		return d.Round(100 * time.Microsecond)
	case d >= time.Millisecond:
		return d.Round(10 * time.Microsecond)
	default:
		return d.Round(time.Microsecond)
	}
}

func formatBytes(n int64) string {
	if n < 1024 {
		return fmt.Sprintf("%d B", n)
	}
	f, unit := float64(n)/1024, "KiB"
	for _, next := range []string{"MiB", "GiB"} {
		if f < 1024 {
			break
		}
		f, unit = f/1024, next
	}
	return fmt.Sprintf("%.1f %s", f, unit)
}

// addSample adds msg to samples, the first few distinct error messages,
// unless it is there already or they are full.
func addSample(samples []string, msg string) []string {
	if len(samples) >= maxErrorSamples || slices.Contains(samples, msg) {
		return samples
	}
	return append(samples, msg)
}
