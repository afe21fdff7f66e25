package upstream_test

import (
	"net/http"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
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
