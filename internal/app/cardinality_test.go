package app

import (
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestProviderSessionsBoundSeries: every session a provider's API lists
// is a series of each onceproxy_upstream_session_* metric (labelled by
// its id), and nothing capped how many sessions the pool took from the
// API: a provider account, or an API answer someone else controls, with
// tens of thousands of sessions was as many series per metric per
// instance (and a transport each). upstream.provider.max_sessions bounds
// them, the same sessions on every instance: the first by id.
func TestProviderSessionsBoundSeries(t *testing.T) {
	const listed = 1500
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: listed})
	env := []string{"ONCEPROXY_UPSTREAM_PROVIDER_API=" + fp.APIURL(), "ONCEPROXY_UPSTREAM_PROVIDER_API_KEY=" + fp.APIKey()}
	text := scrape(t, serveApp(t, "", env))
	series := samples(t, text, "onceproxy_upstream_session_requests_total")
	if most := upstream.DefaultMaxSessions; len(series) > most {
		t.Fatalf("a provider listing %d sessions made %d series of onceproxy_upstream_session_requests_total, want at most %d (upstream.provider.max_sessions)",
			listed, len(series), most)
	}
	// Which ones: the first by id, so that every instance of a fleet
	// takes the same, whatever the order of the answer.
	ids := make([]string, listed)
	for i := range ids {
		ids[i] = "s" + strconv.Itoa(i+1)
	}
	slices.Sort(ids)
	want := map[string]bool{}
	for _, id := range ids[:min(listed, upstream.DefaultMaxSessions)] {
		want[`provider="default",session="`+id+`"`] = true
	}
	for labels := range series {
		if !want[labels] {
			t.Errorf("series {%s}: not among the first %d sessions by id", labels, upstream.DefaultMaxSessions)
			break
		}
	}

	// A smaller cap is taken as it is, and a bad one stops start-up
	// naming its key.
	a := serveApp(t, "", append(env, "ONCEPROXY_UPSTREAM_PROVIDER_MAX_SESSIONS=5"))
	if got := len(samples(t, scrape(t, a), "onceproxy_upstream_session_weight")); got != 5 {
		t.Errorf("max_sessions 5: %d series of onceproxy_upstream_session_weight, want 5", got)
	}
	_, err := LoadConfig(shippedConfig, "", append(env, "ONCEPROXY_UPSTREAM_PROVIDER_MAX_SESSIONS=-1"))
	if err == nil || !strings.Contains(err.Error(), "upstream.provider.max_sessions") {
		t.Errorf("max_sessions -1: %v, want an error naming upstream.provider.max_sessions", err)
	}
}
