package upstream_test

import (
	"net/http"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestInFlightSuccessKeepsNewerCooldown: many requests share a session;
// one of them gets a 429 (Retry-After 600) while another, sent before it,
// is still in flight. That one coming back 200 says nothing about the exit
// IP after the 429: the cooldown stays. It used to end it, so a session
// with requests in flight was never benched by a rate limit, and its
// failures never added up to the escalated cooldown.
func TestInFlightSuccessKeepsNewerCooldown(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 1})
	o := newOrigin(t, false)
	arrived := make(chan struct{}, 1)
	release := make(chan struct{})
	o.setBehave(func(_ string, w http.ResponseWriter, r *http.Request) bool {
		switch r.URL.Path {
		case "/slow":
			arrived <- struct{}{}
			<-release
			return false // 200
		case "/limited":
			w.Header().Set("Retry-After", "600")
			http.Error(w, "slow down", http.StatusTooManyRequests)
			return true
		}
		return false
	})
	logger, _ := testLogger(t)
	p := newPool(t, upstream.Config{Sessions: []upstream.SessionConfig{{ID: "one", URL: fp.URL("s1", "http")}}}, logger)
	hint := clientinfo.Info{Session: "one"}

	slow := make(chan result, 1)
	go func() {
		r, err := send(t, p, http.MethodGet, o.URL+"/slow", hint, "")
		if err != nil {
			t.Errorf("slow request: %v", err)
		}
		slow <- r
	}()
	<-arrived
	if r := mustGet(t, p, o.URL+"/limited", hint); r.status != http.StatusTooManyRequests {
		t.Fatalf("limited request: %+v, want the 429 (no other session)", r)
	}
	if sc, ok := coolingAt(t, statusOf(t, p, "one"), o.URL); !ok || sc.Reason != "rate_limited" {
		close(release)
		t.Fatalf("after the 429: %+v", statusOf(t, p, "one"))
	}
	close(release)
	if r := <-slow; r.status != http.StatusOK {
		t.Fatalf("slow request: %+v", r)
	}
	st := statusOf(t, p, "one")
	if sc, ok := coolingAt(t, st, o.URL); !ok || sc.Reason != "rate_limited" || time.Until(sc.Until) < 590*time.Second {
		t.Fatalf("a request sent before the 429 ended its cooldown: %+v", st)
	}
}
