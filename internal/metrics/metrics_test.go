package metrics

import (
	"testing"
	"time"
)

// TestRequestSeries: each answer counts once in its X-Cache and status
// class series and observes its duration there, whether the series comes
// from the cache of resolved series or, for a value outside it, by label.
func TestRequestSeries(t *testing.T) {
	m := New()
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
		{"HIT from cloudfront", "1xx", 1}, {"BYPASS", "9xx", 1}, {"MISS", "2xx", 0},
	} {
		if got := counts[[2]string{c.xcache, c.class}]; got != c.want {
			t.Errorf("requests_total{cache=%q,class=%q} = %v, want %v", c.xcache, c.class, got, c.want)
		}
	}
	want := map[string]uint64{"HIT": 2, "MISS": 1, "none": 1, "HIT from cloudfront": 1, "BYPASS": 1}
	for k, n := range want {
		if got[k] != n {
			t.Errorf("request_duration_seconds{cache=%q} count = %d, want %d (all: %v)", k, got[k], n, got)
		}
	}
}
