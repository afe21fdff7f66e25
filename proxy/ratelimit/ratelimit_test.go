package ratelimit

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

func TestFixedWindow(t *testing.T) {
	l, err := New(Config{Requests: 3, Window: time.Minute}, nil)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Date(2026, 11, 29, 10, 0, 10, 0, time.UTC)
	l.now = func() time.Time { return now }
	ctx := context.Background()
	for i := range 3 {
		if d := l.Allow(ctx, "a", "site.test"); !d.Allowed || d.Remaining != 2-i {
			t.Fatalf("request %d: %+v", i+1, d)
		}
	}
	d := l.Allow(ctx, "a", "site.test")
	if d.Allowed || d.RetryAfter != 50*time.Second {
		t.Fatalf("4th request: %+v", d)
	}
	if d := l.Allow(ctx, "b", "site.test"); !d.Allowed {
		t.Fatalf("another client was limited: %+v", d)
	}
	now = now.Add(50 * time.Second) // next window
	if d := l.Allow(ctx, "a", "site.test"); !d.Allowed {
		t.Fatalf("new window: %+v", d)
	}
	if l.Rejected() != 1 {
		t.Fatalf("rejected = %d", l.Rejected())
	}
}

type brokenCounter struct{}

func (brokenCounter) IncrWindow(context.Context, string, time.Duration) (int64, error) {
	return 0, errors.New("redis down")
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
		if !l.Allow(context.Background(), "a", "api.internal.test").Allowed {
			t.Fatal("excluded host counted")
		}
	}
	var off *Limiter
	if !off.Allow(context.Background(), "a", "h").Allowed || off.Enabled() {
		t.Fatal("nil limiter limits")
	}
}

func TestClientKey(t *testing.T) {
	trusting, _ := New(Config{Requests: 1, TrustForwardedFor: true}, nil)
	plain, _ := New(Config{Requests: 1}, nil)
	h := http.Header{"X-Forwarded-For": {"203.0.113.7, 10.0.0.1"}, "X-Real-Ip": {"198.51.100.1"}}
	for _, tc := range []struct {
		l               *Limiter
		account, remote string
		h               http.Header
		want            string
	}{
		{plain, "acme", "127.0.0.1:5000", h, "user:acme"},
		{plain, "", "127.0.0.1:5000", h, "ip:127.0.0.1"},
		{plain, "", "[::ffff:127.0.0.2]:5000", nil, "ip:127.0.0.2"},
		{trusting, "", "127.0.0.1:5000", h, "ip:203.0.113.7"},
		{trusting, "", "127.0.0.1:5000", http.Header{"X-Real-Ip": {"198.51.100.1"}}, "ip:198.51.100.1"},
		{trusting, "", "127.0.0.1:5000", http.Header{"X-Forwarded-For": {"garbage"}}, "ip:127.0.0.1"},
	} {
		if got := tc.l.ClientKey(tc.account, tc.remote, tc.h); got != tc.want {
			t.Errorf("ClientKey(%q, %q) = %q, want %q", tc.account, tc.remote, got, tc.want)
		}
	}
}

func TestValidate(t *testing.T) {
	if err := (Config{Requests: -1, Window: time.Millisecond, ExcludeHosts: []string{"["}, PerHostRPS: -1, PerHostBurst: -1}).Validate(); err == nil {
		t.Fatal("bad config accepted")
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
	if off := NewPolite(Config{}, http.DefaultTransport); off.hosts != nil {
		t.Fatal("PerHostRPS 0 keeps a per-host table")
	}
}
