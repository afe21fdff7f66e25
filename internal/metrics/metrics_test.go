package metrics

import (
	"maps"
	"strconv"
	"testing"
	"time"
)

// TestRequestSeries: each answer counts once in its X-Cache and status
// class series and observes its duration there, whether the series comes
// from the cache of resolved series or, for a class outside it, by label.
// An X-Cache the engine does not set (an origin's own, on a protocol
// switch) counts as none.
func TestRequestSeries(t *testing.T) {
	m := New(nil)
	m.Request("HIT", 200, time.Millisecond)
	m.Request("HIT", 204, time.Millisecond)
	m.Request("MISS", 503, time.Second)
	m.Request("", 407, time.Millisecond)
	m.Request("HIT from cloudfront", 101, time.Millisecond)
	m.Request("BYPASS", 999, time.Millisecond)

	mfs, err := m.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	counts := map[[2]string]float64{}
	got := map[string]uint64{}
	for _, mf := range mfs {
		for _, mt := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range mt.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			switch mf.GetName() {
			case "onceproxy_requests_total":
				counts[[2]string{labels["x_cache"], labels["code"]}] = mt.GetCounter().GetValue()
			case "onceproxy_request_duration_seconds":
				got[labels["x_cache"]] = mt.GetHistogram().GetSampleCount()
			}
		}
	}
	for _, c := range []struct {
		xcache, class string
		want          float64
	}{
		{"HIT", "2xx", 2}, {"MISS", "5xx", 1}, {"none", "4xx", 1},
		{"none", "1xx", 1}, {"HIT from cloudfront", "1xx", 0}, {"BYPASS", "9xx", 1}, {"MISS", "2xx", 0},
	} {
		if got := counts[[2]string{c.xcache, c.class}]; got != c.want {
			t.Errorf("requests_total{cache=%q,class=%q} = %v, want %v", c.xcache, c.class, got, c.want)
		}
	}
	want := map[string]uint64{"HIT": 2, "MISS": 1, "none": 2, "HIT from cloudfront": 0, "BYPASS": 1}
	for k, n := range want {
		if got[k] != n {
			t.Errorf("request_duration_seconds{cache=%q} count = %d, want %d (all: %v)", k, got[k], n, got)
		}
	}
}

// TestRequestOriginXCache: on a protocol switch the answer carries the
// origin's own X-Cache, which the dedup layer never set. Any client can
// point the proxy at an origin that sends a new value per answer: each
// used to become a series of its own (unbounded memory here and in
// Prometheus), and one that is not UTF-8 panicked in WithLabelValues,
// after the answer was sent (in goproxy's splice goroutine for a 101).
func TestRequestOriginXCache(t *testing.T) {
	m := New(nil)
	record := func(xcache string) {
		defer func() {
			if p := recover(); p != nil {
				t.Fatalf("Request(%q): panic: %v", xcache, p)
			}
		}()
		m.Request(xcache, 101, time.Second)
	}
	for i := range 100 {
		record("HIT from edge-" + strconv.Itoa(i))
	}
	record("MISS, \xff\xfe")
	record("a\"b\\c\nd")

	mfs, err := m.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		switch mf.GetName() {
		case "onceproxy_requests_total", "onceproxy_request_duration_seconds":
		default:
			continue
		}
		if n := len(mf.GetMetric()); n != 1 {
			t.Errorf("%s: %d series, want 1", mf.GetName(), n)
		}
		for _, mt := range mf.GetMetric() {
			for _, l := range mt.GetLabel() {
				if l.GetName() == "x_cache" && l.GetValue() != "none" {
					t.Errorf("%s{x_cache=%q}: want the origin's X-Cache counted as none", mf.GetName(), l.GetValue())
					break
				}
			}
		}
	}
}

// TestRequestOriginStatus: Go's HTTP/2 client takes any integer in an
// origin's :status (HTTP/1 insists on three digits), so a status is not
// always in 100-999; each hundred outside used to be a code series of its
// own ("123xx", "-1xx"), minted at will by an origin.
func TestRequestOriginStatus(t *testing.T) {
	m := New(nil)
	for _, st := range []int{0, -150, 1000, 12345, 99999, 1 << 40} {
		m.Request("MISS", st, time.Millisecond)
	}
	m.Request("MISS", 999, time.Millisecond)
	mfs, err := m.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	codes := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "onceproxy_requests_total" {
			continue
		}
		for _, mt := range mf.GetMetric() {
			for _, l := range mt.GetLabel() {
				if l.GetName() == "code" {
					codes[l.GetValue()] = mt.GetCounter().GetValue()
				}
			}
		}
	}
	if want := map[string]float64{"0xx": 6, "9xx": 1}; !maps.Equal(codes, want) {
		t.Errorf("code series %v, want %v", codes, want)
	}
}
