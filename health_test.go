package main

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/redistest"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestHealthFollowsRedisWhenIdle: /health's store_available turns false
// while Redis is down and true when it is back on an instance that serves
// no traffic at all (the heartbeat probes Redis, not the requests).
func TestHealthFollowsRedisWhenIdle(t *testing.T) {
	rs := redistest.Start(t)
	origin := httptest.NewTLSServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer origin.Close()
	_, admin := startInstance(t, append(testEnv(t, origin), "ONCEPROXY_REDIS_URL="+rs.URL,
		"ONCEPROXY_REDIS_BREAKER_INTERVAL=300ms"))
	available := func() bool {
		var h struct {
			Store     string `json:"store"`
			Available bool   `json:"store_available"`
		}
		if err := testkit.GetJSON("http://"+admin+"/health", &h); err != nil {
			t.Fatal(err)
		}
		if h.Store != "redis" {
			t.Fatalf("/health says store %q", h.Store)
		}
		return h.Available
	}
	wait := func(want bool) time.Duration {
		t.Helper()
		start := time.Now()
		testkit.Eventually(t, testkit.Patience, func() bool { return available() == want }, "store_available %v", want)
		return time.Since(start)
	}
	wait(true)
	rs.Kill()
	t.Logf("store_available false %s after Redis died", wait(false).Round(time.Millisecond))
	rs.Restart()
	t.Logf("store_available true %s after Redis came back", wait(true).Round(time.Millisecond))
}
