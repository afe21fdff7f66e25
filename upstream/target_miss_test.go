package upstream_test

import (
	"net/http"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestGateway429DoesNotChargeTargetMiss: plain http to a dead
// origin. Session a's gateway says it cannot reach the target
// (Proxy-Status destination_unavailable); the request is tried on b, whose
// gateway rate-limits the session itself (a 429 of its own to the
// absolute-form request). That 429 proves nothing about the target: the
// origin is down for everyone. Session a must not be charged a connection
// error "reachable through another session".
func TestGateway429DoesNotChargeTargetMiss(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	fp.SetMode("s2", fakeprovider.Mode429)
	logger, _ := testLogger(t)
	p := newPool(t, upstream.Config{Sessions: []upstream.SessionConfig{
		{ID: "a", URL: fp.URL("s1", "http")},
		{ID: "b", URL: fp.URL("s2", "http")},
	}}, logger)
	dead := testkit.DeadAddr(t)
	r, err := send(t, p, http.MethodGet, "http://"+dead+"/x", clientinfo.Info{Session: "a"}, "")
	t.Logf("answer: %+v err: %v", r, err)
	if fp.Conns("s1") == 0 || fp.Conns("s2") == 0 {
		t.Fatalf("setup: s1 %d, s2 %d gateway requests", fp.Conns("s1"), fp.Conns("s2"))
	}
	if st := statusOf(t, p, "a"); !st.Available || st.LastOutcome == "connection_error" {
		t.Errorf("session a benched because another session's gateway answered 429 for a dead origin: %+v", st)
	}
}

// TestTargetMissTriesTheRotatedSession: s1's exit IP is rate-limited
// by the origin (429: the origin is up), s1 is rotated to a new exit IP;
// the retry goes to s2, whose gateway answers CONNECT 502 (cannot reach
// the target). An attempt is left and s1's new exit IP has not been
// tried: the request must go there (as it does after any other failure),
// not come back as "target unreachable" for an origin that just answered.
func TestTargetMissTriesTheRotatedSession(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, true)
	cfg := providerConfig(fp)
	cfg.CAFiles = []string{originCAFile(t, o.Server)}
	logger, _ := testLogger(t)
	p := newPool(t, cfg, logger)
	o.rateLimit(exitIP(t, fp, "s1"), time.Second)
	fp.SetMode("s2", fakeprovider.Mode502)
	r, err := send(t, p, http.MethodGet, o.URL+"/x", clientinfo.Info{Session: "s1"}, "")
	if fp.Rotations("s1") != 1 {
		t.Fatalf("setup: s1 rotated %d times", fp.Rotations("s1"))
	}
	if err != nil || r.status != http.StatusOK || r.upstream != "s1" {
		t.Fatalf("got %+v, err %v; want 200 through s1's new exit IP (attempt 3 of 3)", r, err)
	}
}

// TestOriginProxyStatusIsNeverCharged: an origin's own load balancer
// answers one exit IP 502 with a Proxy-Status error, which the gateway
// passes on as it is. It reads like the gateway's "cannot reach the
// target", so the request is tried on another session, which gets the
// page; but a header the origin may have written never charges the first
// session a connection error.
func TestOriginProxyStatusIsNeverCharged(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, false)
	logger, _ := testLogger(t)
	p := newPool(t, upstream.Config{Sessions: []upstream.SessionConfig{
		{ID: "a", URL: fp.URL("s1", "http")},
		{ID: "b", URL: fp.URL("s2", "http")},
	}}, logger)
	blamed := exitIP(t, fp, "s1")
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		if ip != blamed {
			return false
		}
		w.Header().Set("Proxy-Status", "origin-lb; error=connection_refused")
		w.WriteHeader(http.StatusBadGateway)
		return true
	})
	if r := mustGet(t, p, o.URL+"/x", clientinfo.Info{Session: "a"}); r.status != 200 || r.upstream != "b" {
		t.Fatalf("got %+v, want b's 200", r)
	}
	if st := statusOf(t, p, "a"); !st.Available || st.LastOutcome == "connection_error" {
		t.Errorf("session a charged for its origin's own Proxy-Status: %+v", st)
	}
}
