package upstream_test

import (
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestOneOriginsErrorsDoNotBenchThePool: one site is down (its own load
// balancer answers 503 to everyone). That says nothing about the exit
// IPs: every other site must still be reachable through the same
// sessions. Three such answers in a row used to escalate each session to
// the ten-minute cooldown, so a single dead site took the whole pool out
// for every other one.
func TestOneOriginsErrorsDoNotBenchThePool(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	down := newOrigin(t, false)
	down.setBehave(func(_ string, w http.ResponseWriter, _ *http.Request) bool {
		http.Error(w, "service unavailable", http.StatusServiceUnavailable)
		return true
	})
	up := newOrigin(t, false)
	logger, _ := testLogger(t)
	p := newPool(t, providerConfig(fp), logger)
	for range 5 {
		if r := mustGet(t, p, down.URL+"/", clientinfo.Info{}); r.status != http.StatusServiceUnavailable {
			t.Fatalf("the dead site: %+v, want its 503", r)
		}
	}
	r, err := send(t, p, http.MethodGet, up.URL+"/", clientinfo.Info{}, "")
	if err != nil || r.status != http.StatusOK {
		t.Fatalf("another site after the dead one's 503s: %+v, %v; sessions %+v", r, err, p.Sessions())
	}
}

// TestOneHangingOriginDoesNotBenchThePool: one site stops answering (its
// requests time out waiting for the response headers, on every session
// alike). That is the site's trouble, not the sessions': the other sites
// must still be reachable through them.
func TestOneHangingOriginDoesNotBenchThePool(t *testing.T) {
	t.Run("http", func(t *testing.T) { testOneHangingOriginDoesNotBenchThePool(t, false) })
	t.Run("https", func(t *testing.T) { testOneHangingOriginDoesNotBenchThePool(t, true) })
}

func testOneHangingOriginDoesNotBenchThePool(t *testing.T, useTLS bool) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	hang := newOrigin(t, useTLS)
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	hang.setBehave(func(_ string, w http.ResponseWriter, r *http.Request) bool {
		select {
		case <-stop:
		case <-r.Context().Done():
		}
		return true
	})
	fine := newOrigin(t, useTLS)
	logger, _ := testLogger(t)
	cfg := providerConfig(fp)
	cfg.ResponseHeaderTimeout = 150 * time.Millisecond
	if useTLS {
		cfg.CAFiles = []string{originCAFile(t, hang.Server), originCAFile(t, fine.Server)}
	}
	p := newPool(t, cfg, logger)
	for range 3 {
		if r, err := send(t, p, http.MethodGet, hang.URL+"/", clientinfo.Info{}, ""); err == nil {
			t.Fatalf("the hanging site answered: %+v", r)
		}
	}
	r, err := send(t, p, http.MethodGet, fine.URL+"/", clientinfo.Info{}, "")
	if err != nil || r.status != http.StatusOK {
		t.Fatalf("another site after the hanging one's timeouts: %+v, %v; sessions %+v", r, err, p.Sessions())
	}
}

// TestHangingExitIsChargedOnceAnotherAnswers: the origin answers every
// exit IP but one, whose requests time out. The request still gets its
// answer through another session, and the session that could not is
// charged a connection error: the origin was reachable, its exit was not.
func TestHangingExitIsChargedOnceAnotherAnswers(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, false)
	bad := exitIP(t, fp, "s1")
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	o.setBehave(func(ip string, _ http.ResponseWriter, r *http.Request) bool {
		if ip != bad {
			return false
		}
		select {
		case <-stop:
		case <-r.Context().Done():
		}
		return true
	})
	logger, _ := testLogger(t)
	cfg := providerConfig(fp)
	cfg.ResponseHeaderTimeout = 150 * time.Millisecond
	p := newPool(t, cfg, logger)
	r := mustGet(t, p, o.URL+"/", clientinfo.Info{Session: "s1"})
	if r.status != http.StatusOK || r.upstream != "s2" {
		t.Fatalf("got %+v, want 200 through s2", r)
	}
	if st := statusOf(t, p, "s1"); st.Available || st.CooldownReason != "connection_error" || st.ConsecutiveFailures != 1 {
		t.Fatalf("s1, which timed out where s2 answered: %+v", st)
	}
	if st := statusOf(t, p, "s2"); !st.Available || st.ConsecutiveFailures != 0 {
		t.Fatalf("s2: %+v", st)
	}
}

// TestHealthURLDownBenchesNoSession: health.url is meant to be always up,
// but it is one site like any other. When it hangs for every session, the
// probes say so of the URL, not of each session: none is charged, and
// traffic to every other site goes on through them.
func TestHealthURLDownBenchesNoSession(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	down := newOrigin(t, false)
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	var probes atomic.Int32
	down.setBehave(func(_ string, _ http.ResponseWriter, r *http.Request) bool {
		probes.Add(1)
		select {
		case <-stop:
		case <-r.Context().Done():
		}
		return true
	})
	fine := newOrigin(t, false)
	logger, logs := testLogger(t)
	cfg := providerConfig(fp)
	cfg.Health = upstream.HealthConfig{URL: down.URL + "/ip", Interval: 20 * time.Millisecond, Timeout: 150 * time.Millisecond}
	p := newPool(t, cfg, logger)
	runPool(t, p)
	// Rounds run one after the other: a probe of the second means the
	// first is over, its marks made.
	testkit.Eventually(t, testkit.Patience, func() bool { return probes.Load() >= 3 }, "a second round of probes")
	for _, id := range []string{"s1", "s2"} {
		if st := statusOf(t, p, id); !st.Available || st.ConsecutiveFailures != 0 {
			t.Errorf("%s after health.url hung for every session: %+v", id, st)
		}
	}
	if r, err := send(t, p, http.MethodGet, fine.URL+"/", clientinfo.Info{}, ""); err != nil || r.status != http.StatusOK {
		t.Fatalf("another site while health.url hangs: %+v, %v", r, err)
	}
	if !strings.Contains(logs.String(), "health.url") {
		t.Errorf("nothing in the log says health.url is down:\n%s", logs.String())
	}
}

// coolingAt is st's cooldown at the site of rawURL (its host and port),
// if the session sits it out.
func coolingAt(t *testing.T, st upstream.SessionStatus, rawURL string) (upstream.SiteCooldown, bool) {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	site := strings.ToLower(u.Host)
	if u.Port() == "" {
		site += map[string]string{"http": ":80", "https": ":443"}[u.Scheme]
	}
	for _, c := range st.CoolingSites {
		if c.Host == site {
			return c, true
		}
	}
	return upstream.SiteCooldown{}, false
}

// TestHealthProbesChargeAHangingGateway: every session's gateway accepts
// and says nothing to CONNECT, and the probes' own timeout ends them. That
// is no hanging health.url (the request never got past the gateway): the
// sessions are charged, as when one gateway of several hangs.
func TestHealthProbesChargeAHangingGateway(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, true) // https: a CONNECT, which the gateways leave hanging
	var probes atomic.Int32
	o.setBehave(func(string, http.ResponseWriter, *http.Request) bool { probes.Add(1); return false })
	fp.SetMode("s1", fakeprovider.ModeHang)
	fp.SetMode("s2", fakeprovider.ModeHang)
	t.Cleanup(func() { fp.SetMode("s1", fakeprovider.ModeOK); fp.SetMode("s2", fakeprovider.ModeOK) })
	logger, _ := testLogger(t)
	cfg := providerConfig(fp)
	cfg.DialTimeout = 10 * time.Second // the probe's timeout comes first
	cfg.CAFiles = []string{originCAFile(t, o.Server)}
	cfg.Health = upstream.HealthConfig{URL: o.URL + "/ip", Interval: 20 * time.Millisecond, Timeout: 150 * time.Millisecond}
	p := newPool(t, cfg, logger)
	runPool(t, p)
	testkit.Eventually(t, testkit.Patience, func() bool {
		for _, id := range []string{"s1", "s2"} {
			if st := statusOf(t, p, id); st.Available || st.LastOutcome != "connection_error" {
				return false
			}
		}
		return true
	}, "both sessions charged for their hanging gateway")
	if n := probes.Load(); n != 0 {
		t.Errorf("health.url got %d probes through gateways that hang", n)
	}
}
