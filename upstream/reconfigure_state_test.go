package upstream_test

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestReconfigureProviderClientKeepsHealth: a reload that changes how the
// provider's API is called (its timeout here; a rotated API key alike)
// builds a new API client, but the provider lists the same sessions: they
// keep their cooldowns. They used to come back fresh, so a rate-limited
// exit IP was sent requests again right after the reload.
func TestReconfigureProviderClientKeepsHealth(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, false)
	logger, _ := testLogger(t)
	cfg := providerConfig(fp)
	p := newPool(t, cfg, logger)
	fp.SetMode("s1", fakeprovider.Mode429)
	if r := mustGet(t, p, o.URL, clientinfo.Info{Session: "s1"}); r.status != 200 || r.upstream != "s2" {
		t.Fatalf("first request: %+v, want s2 after s1's 429", r)
	}
	before := statusOf(t, p, "s1")
	if before.Available || before.CooldownReason != "rate_limited" {
		t.Fatalf("s1 did not cool down: %+v", before)
	}

	next := cfg
	next.Provider.Timeout = 7 * time.Second
	if err := p.Reconfigure(next); err != nil {
		t.Fatal(err)
	}
	after := statusOf(t, p, "s1")
	if after.Available || after.CooldownReason != "rate_limited" || !after.CooldownUntil.Equal(before.CooldownUntil) ||
		after.ConsecutiveFailures != before.ConsecutiveFailures || after.Weight != before.Weight {
		t.Fatalf("s1 lost its health across the reload:\nbefore %+v\nafter  %+v", before, after)
	}
	if r := mustGet(t, p, o.URL, clientinfo.Info{Session: "s1"}); r.upstream != "s2" {
		t.Fatalf("after the reload a request for s1 went through %q, want s2 (s1 is cooling down)", r.upstream)
	}
}

// TestRequestAcrossAReloadMarksTheSuccessor: a request still running on a
// session when a reload replaces it under its id (a new API client here)
// marks the session that took its place: its 429 cools the session down,
// and its count is not lost. It used to mark the retired session, which
// nothing reads any more: the exit IP it rate-limited stayed in use.
func TestRequestAcrossAReloadMarksTheSuccessor(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, false)
	arrived := make(chan struct{}, 1)
	gate := testkit.NewGate(t)
	o.setBehave(func(_ string, w http.ResponseWriter, r *http.Request) bool {
		if r.URL.Path != "/slow" {
			return false
		}
		select {
		case arrived <- struct{}{}:
		default:
		}
		gate.Wait(r.Context())
		w.Header().Set("Retry-After", "600")
		w.WriteHeader(http.StatusTooManyRequests)
		return true
	})
	logger, _ := testLogger(t)
	cfg := upstream.Config{Sessions: []upstream.SessionConfig{
		{ID: "a", URL: fp.URL("s1", "http"), Weight: 5},
		{ID: "b", URL: fp.URL("s2", "http"), Weight: 5},
	}}
	cfg.Retry.MaxAttempts = 1
	p := newPool(t, cfg, logger)
	mustGet(t, p, o.URL, clientinfo.Info{Session: "a"})
	done := make(chan result, 1)
	go func() {
		r, _ := send(t, p, http.MethodGet, o.URL+"/slow", clientinfo.Info{Session: "a"}, "")
		done <- r
	}()
	<-arrived
	// A new weight rebuilds session a under its id.
	next := cfg
	next.Sessions = append([]upstream.SessionConfig(nil), cfg.Sessions...)
	next.Sessions[0].Weight = 6
	if err := p.Reconfigure(next); err != nil {
		t.Fatal(err)
	}
	gate.Open()
	if r := <-done; r.status != http.StatusTooManyRequests {
		t.Fatalf("the request across the reload: %+v, want the origin's 429", r)
	}
	after := statusOf(t, p, "a")
	if sc, ok := coolingAt(t, after, o.URL); !ok || sc.Reason != "rate_limited" {
		t.Errorf("a after a 429 that arrived past the reload: %+v, want it cooling down at the origin's site", after)
	}
	if after.Requests != 2 {
		t.Errorf("a counts %d requests, want 2: the one across the reload was lost", after.Requests)
	}
}

// TestReconfigureStartsHealthChecks: a reload that sets health.url (or
// shortens health.interval) probes at once, not when the interval the
// checker was started with runs out (an hour here). It used to wait.
func TestReconfigureStartsHealthChecks(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 1})
	o := newOrigin(t, false)
	logger, _ := testLogger(t)
	cfg := upstream.Config{
		Sessions: []upstream.SessionConfig{{ID: "a", URL: fp.URL("s1", "http")}},
		Health:   upstream.HealthConfig{Interval: time.Hour},
	}
	p := newPool(t, cfg, logger)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	defer func() { cancel(); <-done }()

	next := cfg
	next.Health = upstream.HealthConfig{URL: o.URL + "/ip", Interval: time.Hour}
	if err := p.Reconfigure(next); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return statusOf(t, p, "a").ExitIP == exitIP(t, fp, "s1") },
		"a health probe after health.url was set by a reload")
}

// TestReloadsDoNotPostponeRefreshes: a reload restarts the providers'
// refresh loops; the time since the last fetch counts, so reloads more
// frequent than provider.refresh do not keep the list from ever being
// fetched again. The restarted loop used to wait a whole interval.
func TestReloadsDoNotPostponeRefreshes(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 1})
	logger, _ := testLogger(t)
	cfg := providerConfig(fp)
	cfg.Provider.Refresh = time.Hour
	p := newPool(t, cfg, logger)
	var ahead atomic.Int64 // how far the pool's clock is ahead of the real one
	upstream.SetClock(p, func() time.Time { return time.Now().Add(time.Duration(ahead.Load())) })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	defer func() { cancel(); <-done }()

	calls := fp.APICalls() // the list fetched by New
	ahead.Store(int64(2 * time.Hour))
	if err := p.Reconfigure(cfg); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return fp.APICalls() > calls },
		"a refresh after a reload, two refresh intervals after the last one")
}
