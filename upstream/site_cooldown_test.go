package upstream_test

import (
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestSiteRateLimitSitsOutThatSite: a site that rate-limits every exit IP
// (a site-wide limit) answers 429 through each session. A 429 speaks of an
// exit IP at that site only: the sessions sit that site out, and every
// other site goes on through them. Benched for every site, as they were,
// one request to such a site rotated and benched the whole pool, and the
// traffic to every other site got 503s for a minute.
func TestSiteRateLimitSitsOutThatSite(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	limited := newOrigin(t, false)
	limited.setBehave(func(_ string, w http.ResponseWriter, _ *http.Request) bool {
		w.Header().Set("Retry-After", "120")
		http.Error(w, "slow down", http.StatusTooManyRequests)
		return true
	})
	fine := newOrigin(t, false)
	logger, _ := testLogger(t)
	p := newPool(t, providerConfig(fp), logger)
	if r := mustGet(t, p, limited.URL+"/", clientinfo.Info{}); r.status != http.StatusTooManyRequests {
		t.Fatalf("the limited site: %+v, want its 429 in the end", r)
	}
	for _, id := range []string{"s1", "s2"} {
		st := statusOf(t, p, id)
		sc, ok := coolingAt(t, st, limited.URL)
		if !st.Available || !ok || sc.Reason != "rate_limited" || sc.Remaining != "2m0s" {
			t.Errorf("%s after the site's 429: %+v", id, st)
		}
	}
	if n := p.SiteCooldowns(); n != 2 {
		t.Errorf("SiteCooldowns = %d, want both sessions at the one site", n)
	}
	for range 4 {
		if r, err := send(t, p, http.MethodGet, fine.URL+"/", clientinfo.Info{}, ""); err != nil || r.status != http.StatusOK {
			t.Fatalf("another site after one site's 429s: %+v, %v", r, err)
		}
	}
	// The limited site itself waits, without a request upstream.
	seen := func() int {
		limited.mu.Lock()
		defer limited.mu.Unlock()
		return len(limited.seen)
	}
	hits := seen()
	_, err := send(t, p, http.MethodGet, limited.URL+"/", clientinfo.Info{}, "")
	var ex *upstream.ExhaustedError
	if !errors.As(err, &ex) || !strings.Contains(ex.Reason, "cooling down for 127.0.0.1:") || ex.NextReady <= 0 {
		t.Fatalf("the limited site while its cooldowns last: %v, want every session cooling down for it", err)
	}
	if n := seen(); n != hits {
		t.Errorf("the limited site got %d more requests while every session sat it out", n-hits)
	}
}

// TestStickyKeyStaysForOtherSites: a client's sticky session meets a 429
// at another site than the one it is used for. That site's requests go
// through another session while it sits it out; the key itself stays on
// its session for every other site (whose exit IP the 429's rotation
// changed, as it would have without a sticky key). In a fleet the key
// moved to another session for good, fleet-wide, on the other site's
// request.
func TestStickyKeyStaysForOtherSites(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 3})
	home := newOrigin(t, false)
	limited := newOrigin(t, false)
	cfg := upstream.Config{Sessions: []upstream.SessionConfig{
		{ID: "a", URL: fp.URL("s1", "http")}, {ID: "b", URL: fp.URL("s2", "http")}, {ID: "c", URL: fp.URL("s3", "http")}}}
	aloneAndFleet(t, cfg, func(t *testing.T, p *upstream.Pool) {
		info := clientinfo.Info{Account: "acct", Session: "login"}
		first := mustGet(t, p, home.URL, info)
		sticky := first.upstream
		limited.setBehave(func(ip string, w http.ResponseWriter, _ *http.Request) bool {
			if s, _ := fp.Session(map[string]string{"a": "s1", "b": "s2", "c": "s3"}[sticky]); ip == s.ExitIP {
				http.Error(w, "slow down", http.StatusTooManyRequests)
				return true
			}
			return false
		})
		t.Cleanup(func() { limited.setBehave(nil) })
		if r := mustGet(t, p, limited.URL, info); r.status != http.StatusOK || r.upstream == sticky {
			t.Fatalf("the limited site: %+v, want a 200 through another session than %s", r, sticky)
		}
		if r := mustGet(t, p, home.URL, info); r.upstream != sticky {
			t.Errorf("the first site after another site's 429: through %s, want the sticky %s", r.upstream, sticky)
		}
	})
}
