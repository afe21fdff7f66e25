package loadgen

import (
	"strings"
	"testing"
	"time"
)

func TestPercentile(t *testing.T) {
	hundred := make([]time.Duration, 100)
	for i := range hundred {
		hundred[i] = time.Duration(i + 1)
	}
	for _, tc := range []struct {
		name   string
		sorted []time.Duration
		p      int
		want   time.Duration
	}{
		{"empty", nil, 50, 0},
		{"one", []time.Duration{7}, 99, 7},
		{"two p50", []time.Duration{1, 2}, 50, 1},
		{"two p99", []time.Duration{1, 2}, 99, 2},
		{"hundred p50", hundred, 50, 50},
		{"hundred p90", hundred, 90, 90},
		{"hundred p99", hundred, 99, 99},
		{"hundred p100", hundred, 100, 100},
		{"p0", hundred, 0, 1},
	} {
		if g := percentile(tc.sorted, tc.p); g != tc.want {
			t.Errorf("%s: percentile(p%d) = %v, want %v", tc.name, tc.p, g, tc.want)
		}
	}
}

func TestResultString(t *testing.T) {
	r := &Result{
		Requests:     3,
		Errors:       1,
		ErrorSamples: []string{"Get: connection refused"},
		Duration:     1500 * time.Millisecond,
		RPS:          2,
		Status:       map[int]int{200: 1, 502: 1},
		XCache:       map[string]int{"MISS": 1, "HIT": 1},
		Protos:       map[string]int{"HTTP/1.1": 2},
		BytesRead:    3 << 20,
	}
	r.setLatencies([]time.Duration{3 * time.Millisecond, time.Millisecond})
	s := r.String()
	for _, want := range []string{
		"requests 3 in 1.5s (2.0 req/s), 1 errors",
		"p50 1ms",
		"max 3ms",
		"status   200=1 502=1",
		"x-cache  HIT=1 MISS=1",
		"proto    HTTP/1.1=2",
		"read     3.0 MiB",
		"error    Get: connection refused",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("String() lacks %q:\n%s", want, s)
		}
	}
}

func TestFormatBytes(t *testing.T) {
	for _, tc := range []struct {
		n    int64
		want string
	}{
		{0, "0 B"},
		{1023, "1023 B"},
		{1024, "1.0 KiB"},
		{5 << 20, "5.0 MiB"},
		{3 << 40, "3072.0 GiB"},
	} {
		if g := formatBytes(tc.n); g != tc.want {
			t.Errorf("formatBytes(%d) = %q, want %q", tc.n, g, tc.want)
		}
	}
}

// TestMerge: rounds add up, and the percentiles are those of every
// request of every round, not an average of the rounds' own.
func TestMerge(t *testing.T) {
	a := &Result{Requests: 3, Errors: 1, ErrorSamples: []string{"x"}, Duration: time.Second, BytesRead: 10,
		Status: map[int]int{200: 2, 502: 1}, XCache: map[string]int{"MISS": 2}, Protos: map[string]int{"HTTP/1.1": 2}}
	a.setLatencies([]time.Duration{1, 2})
	b := &Result{Requests: 2, ErrorSamples: []string{"x", "y"}, Duration: 3 * time.Second, BytesRead: 5,
		Status: map[int]int{200: 2}, XCache: map[string]int{"HIT": 2}, Protos: map[string]int{"HTTP/2.0": 2}}
	b.setLatencies([]time.Duration{100, 3})
	m := Merge(a, b)
	if m.Requests != 5 || m.Errors != 1 || m.Duration != 4*time.Second || m.BytesRead != 15 || m.RPS != 1.25 {
		t.Errorf("Merge: requests %d errors %d duration %v bytes %d rps %v, want 5 1 4s 15 1.25", m.Requests, m.Errors, m.Duration, m.BytesRead, m.RPS)
	}
	if m.Status[200] != 4 || m.Status[502] != 1 || m.XCache["MISS"] != 2 || m.XCache["HIT"] != 2 || m.Protos["HTTP/2.0"] != 2 {
		t.Errorf("Merge: counts %v %v %v", m.Status, m.XCache, m.Protos)
	}
	if strings.Join(m.ErrorSamples, ",") != "x,y" {
		t.Errorf("Merge: error samples %q, want x and y once each", m.ErrorSamples)
	}
	// Latencies 1, 2, 3, 100: p50 is 2, p99 and max 100.
	if m.P50 != 2 || m.P99 != 100 || m.Max != 100 {
		t.Errorf("Merge: p50 %v p99 %v max %v, want 2 100 100", m.P50, m.P99, m.Max)
	}
}
