package ratelimit

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// clocked returns a limiter counting in this process by a clock the test
// moves.
func clocked(t *testing.T, cfg Config) (*Limiter, *time.Time) {
	t.Helper()
	l, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	now := time.Date(2026, 11, 29, 10, 0, 10, 0, time.UTC)
	l.own.now = func() time.Time { return now }
	return l, &now
}

func TestAllowance(t *testing.T) {
	l, now := clocked(t, Config{Requests: 3, Window: time.Minute})
	ctx := context.Background()
	for i := range 3 {
		if d := l.Allow(ctx, "a", "site.test"); !d.Allowed || d.Remaining != 2-i {
			t.Fatalf("request %d: %+v", i+1, d)
		}
	}
	d := l.Allow(ctx, "a", "site.test")
	if d.Allowed || d.RetryAfter != 20*time.Second || d.Limit != 3 {
		t.Fatalf("4th request: %+v, want refused, retry in 20s (a minute's third)", d)
	}
	if d := l.Allow(ctx, "b", "site.test"); !d.Allowed {
		t.Fatalf("another client was limited: %+v", d)
	}
	*now = now.Add(19 * time.Second)
	if d := l.Allow(ctx, "a", "site.test"); d.Allowed || d.RetryAfter != time.Second {
		t.Fatalf("19s later: %+v, want refused for 1s more", d)
	}
	*now = now.Add(time.Second)
	if d := l.Allow(ctx, "a", "site.test"); !d.Allowed || d.Remaining != 0 {
		t.Fatalf("20s later: %+v, want one more admitted", d)
	}
	if d := l.Allow(ctx, "a", "site.test"); d.Allowed {
		t.Fatalf("right after it: %+v", d)
	}
	if l.Rejected() != 3 {
		t.Fatalf("rejected = %d, want 3", l.Rejected())
	}
}

// TestNoDoubleBurstAtTheWindowEdge: a client that spends its allowance at
// the end of one minute gets nothing more at the start of the next. With
// the fixed windows of before, 10 requests at 10:00:59.9 and 10 more at
// 10:01:00.1 all went through: twice the limit within 200ms.
func TestNoDoubleBurstAtTheWindowEdge(t *testing.T) {
	l, now := clocked(t, Config{Requests: 10, Window: time.Minute})
	*now = time.Date(2026, 11, 29, 10, 0, 59, 900_000_000, time.UTC)
	admitted := 0
	for _, at := range []time.Duration{0, 200 * time.Millisecond} {
		*now = now.Add(at)
		for range 10 {
			if l.Allow(context.Background(), "a", "site.test").Allowed {
				admitted++
			}
		}
	}
	if admitted != 10 {
		t.Fatalf("%d requests admitted across the minute's edge within 200ms, want 10", admitted)
	}
}

// TestAllowanceOverTime: a client sending a request every second for ten
// minutes at 3 a minute gets its burst of 3 and then one every 20s.
func TestAllowanceOverTime(t *testing.T) {
	l, now := clocked(t, Config{Requests: 3, Window: time.Minute})
	admitted := 0
	for range 600 {
		if l.Allow(context.Background(), "a", "site.test").Allowed {
			admitted++
		}
		*now = now.Add(time.Second)
	}
	if want := 3 + 599/20; admitted != want {
		t.Fatalf("%d admitted in 10 minutes, want %d", admitted, want)
	}
}

// TestConcurrentTakes: requests racing on one client are admitted exactly
// up to the limit.
func TestConcurrentTakes(t *testing.T) {
	l, _ := clocked(t, Config{Requests: 50, Window: time.Minute})
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for range 200 {
		wg.Go(func() {
			if l.Allow(context.Background(), "a", "site.test").Allowed {
				admitted.Add(1)
			}
		})
	}
	wg.Wait()
	if n := admitted.Load(); n != 50 {
		t.Fatalf("%d of 200 concurrent requests admitted, want 50", n)
	}
}

type brokenCounter struct{}

func (brokenCounter) Take(context.Context, string, time.Duration, time.Duration) (time.Duration, bool, error) {
	return 0, false, errors.New("redis down")
}

func TestFailOpenAndClosed(t *testing.T) {
	open, _ := New(Config{Requests: 1}, brokenCounter{})
	if d := open.Allow(context.Background(), "a", "h"); !d.Allowed || !d.Unavailable {
		t.Fatalf("fail open: %+v", d)
	}
	closed, _ := New(Config{Requests: 1, FailClosed: true}, brokenCounter{})
	if d := closed.Allow(context.Background(), "a", "h"); d.Allowed || !d.Unavailable {
		t.Fatalf("fail closed: %+v", d)
	}
}

func TestExcludeHostsAndOff(t *testing.T) {
	l, _ := New(Config{Requests: 1, ExcludeHosts: []string{"*.internal.test"}}, nil)
	for range 5 {
		for _, h := range []string{"api.internal.test", "a.b.internal.test", "API.Internal.Test."} {
			if !l.Allow(context.Background(), "a", h).Allowed {
				t.Fatalf("excluded host %s counted", h)
			}
		}
	}
	// The domain itself is not below it: counted.
	l.Allow(context.Background(), "a", "internal.test")
	if l.Allow(context.Background(), "a", "internal.test").Allowed {
		t.Fatal("internal.test is excluded by *.internal.test")
	}
	var off *Limiter
	if !off.Allow(context.Background(), "a", "h").Allowed || off.Enabled() {
		t.Fatal("nil limiter limits")
	}
}

func TestValidate(t *testing.T) {
	if err := (Config{Requests: 2_000_000, Window: time.Second}).Validate(); err == nil || !strings.Contains(err.Error(), "requests:") {
		t.Errorf("2,000,000 requests a second: %v, want refused (more than one per microsecond)", err)
	}
	err := (Config{Requests: -1, Window: time.Millisecond, ExcludeHosts: []string{"ok.test", "*internal.test"}, PerHostRPS: -1, PerHostBurst: -1}).Validate()
	if err == nil {
		t.Fatal("bad config accepted")
	}
	for _, want := range []string{"requests:", "window:", `exclude_hosts[1]: "*internal.test"`, "per_host_rps:", "per_host_burst:"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
}

// TestPolitePacesPerHost: with 5 requests/s and no burst, the third request
// to one host cannot start before 400ms; another host is not held back.
func TestPolitePacesPerHost(t *testing.T) {
	var n atomic.Int64
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { n.Add(1) }))
	defer origin.Close()
	rt := NewPolite(Config{PerHostRPS: 5, PerHostBurst: 1}, http.DefaultTransport)
	defer rt.Close()
	start := time.Now()
	for range 3 {
		req, _ := http.NewRequest(http.MethodGet, origin.URL, nil)
		resp, err := rt.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	if el := time.Since(start); el < 390*time.Millisecond {
		t.Fatalf("3 requests at 5/s took only %s", el)
	}
	// A request whose deadline cannot wait for its turn fails at once.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, origin.URL, nil)
	if _, err := rt.RoundTrip(req); err == nil {
		t.Fatal("request that could not get a turn went out")
	}
	if off := NewPolite(Config{}, http.DefaultTransport); off.pace.Load() != nil {
		t.Fatal("PerHostRPS 0 keeps a per-host table")
	}
}

// TestReloadKeepsThePace: a reload that leaves per_host_rps and
// per_host_burst alone keeps each host's bucket (a host that just had its
// turn still waits); one that changes them starts every host afresh.
func TestReloadKeepsThePace(t *testing.T) {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	defer origin.Close()
	cfg := Config{PerHostRPS: 0.5, PerHostBurst: 1}
	rt := NewPolite(cfg, http.DefaultTransport)
	defer rt.Close()
	send := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, origin.URL, nil)
		resp, err := rt.RoundTrip(req)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	if err := send(); err != nil {
		t.Fatalf("the first request: %v", err)
	}
	rt.Reconfigure(cfg)
	if err := send(); err == nil {
		t.Fatal("a reload with the same pace gave the host a fresh bucket")
	}
	rt.Reconfigure(Config{PerHostRPS: 0.5, PerHostBurst: 2})
	if err := send(); err != nil {
		t.Fatalf("after a new pace: %v", err)
	}
}

// okTransport answers every request with an empty 200 and counts them.
type okTransport struct{ n atomic.Int64 }

func (o *okTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	o.n.Add(1)
	return &http.Response{StatusCode: http.StatusOK, Body: http.NoBody, Request: req}, nil
}

// TestPoliteOneBucketPerHost: the spellings of one host name share its bucket, as host patterns treat them as one
// name everywhere (any case, a trailing dot ignored, no port). "site.test." used to get a bucket of its own, so
// a fully qualified link doubled the pace at that site.
func TestPoliteOneBucketPerHost(t *testing.T) {
	next := &okTransport{}
	// One request per 100 s: after the first, no request to the host can get a turn within its deadline.
	rt := NewPolite(Config{PerHostRPS: 0.01, PerHostBurst: 1}, next)
	defer rt.Close()
	send := func(url string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := rt.RoundTrip(req)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	if err := send("http://site.test/a"); err != nil {
		t.Fatalf("the first request: %v", err)
	}
	for _, url := range []string{"http://SITE.test/b", "http://site.test./c", "http://Site.Test.:8080/d"} {
		if err := send(url); err == nil {
			t.Errorf("%s got a turn of its own right after http://site.test/a", url)
		}
	}
	if err := send("http://other.test/"); err != nil {
		t.Errorf("another host was held back: %v", err)
	}
	if got := next.n.Load(); got != 2 {
		t.Errorf("%d requests went out, want 2", got)
	}
}
