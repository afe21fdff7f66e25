package main

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/logbuf"
	"github.com/seed-a3c387e8/onceproxy/internal/pgtest"
	"github.com/seed-a3c387e8/onceproxy/internal/redistest"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestStickyKeysAgreeAcrossInstances (Redis) and
// TestPostgresStickyKeysAgreeAcrossInstances: three whole programs share
// one store and one provider, refreshing its list at different paces (1s,
// 4s, 60s). For 100 sticky keys (session names that name no session)
// every instance uses the same session; so they do for 100 new keys while
// only some instances have listed a session the provider just added (each
// instance alone would hash some keys to it and others not); and when the
// session of some keys is rate-limited, all three move those keys to one
// same new session, and no other key moves.
func TestStickyKeysAgreeAcrossInstances(t *testing.T) {
	rs := redistest.Start(t)
	stickyFleet(t, func(t *testing.T) []string {
		return append(testEnv(t, httptest.NewTLSServer(nil)), "ONCEPROXY_REDIS_URL="+rs.URL)
	})
}

func TestPostgresStickyKeysAgreeAcrossInstances(t *testing.T) {
	url, schema := pgtest.Schema(t)
	stickyFleet(t, func(t *testing.T) []string { return pgEnv(t, url, schema) })
}

func stickyFleet(t *testing.T, storeEnv func(t *testing.T) []string) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 4})
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ip, _, _ := net.SplitHostPort(r.RemoteAddr)
		io.WriteString(w, ip)
	}))
	defer origin.Close()
	logs := &logbuf.Buffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("instance logs:\n%s", logs)
		}
	})
	type inst struct{ proxy, admin string }
	var fleet []inst
	for _, refresh := range []string{"1s", "4s", "60s"} {
		env := append(storeEnv(t), "ONCEPROXY_UPSTREAM_PROVIDER_API="+fp.APIURL(),
			"ONCEPROXY_UPSTREAM_PROVIDER_API_KEY="+fp.APIKey(), "ONCEPROXY_UPSTREAM_PROVIDER_REFRESH="+refresh,
			"ONCEPROXY_DEDUP_ENABLED=false", "ONCEPROXY_LOG_ACCESS=false")
		p, a := startLogged(t, env, logs)
		fleet = append(fleet, inst{p, a})
	}
	clients := make([]*http.Client, len(fleet))
	for i, in := range fleet {
		clients[i] = plainClient(in.proxy, "", "")
	}
	// via asks instance i for key's session.
	via := func(i int, key string) string {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, origin.URL+"/"+key, nil)
		req.Header.Set("X-Onceproxy-Session", key)
		resp, err := clients[i].Do(req)
		if err != nil {
			t.Fatalf("instance %d, key %s: %v", i, key, err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("instance %d, key %s: %d", i, key, resp.StatusCode)
		}
		return resp.Header.Get("X-Onceproxy-Upstream")
	}
	// agree asks every instance for each key, first instance first in
	// turn, and returns the one session they all used.
	agree := func(what string, keys []string) map[string]string {
		t.Helper()
		out := map[string]string{}
		for k, key := range keys {
			var got []string
			for j := range fleet {
				got = append(got, via((k+j)%len(fleet), key))
			}
			if slices.Compact(slices.Clone(got))[0] != got[0] || len(slices.Compact(slices.Clone(got))) != 1 {
				t.Fatalf("%s: key %s went to %v on the three instances", what, key, got)
			}
			out[key] = got[0]
		}
		return out
	}
	keys := func(from, n int) []string {
		var out []string
		for i := range n {
			out = append(out, fmt.Sprintf("crawl-%d", from+i))
		}
		return out
	}
	listed := func(admin string) []string {
		var st struct {
			Sessions []upstream.SessionStatus `json:"sessions"`
		}
		if err := testkit.GetJSON("http://"+admin+"/upstream/sessions", &st); err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, s := range st.Sessions {
			ids = append(ids, s.ID)
		}
		return ids
	}

	first := agree("same lists", keys(0, 100))

	// A new session: the 1s instance lists it first, the 60s one not yet.
	fp.AddSession(fakeprovider.Sticky, 0)
	testkit.Eventually(t, testkit.Patience, func() bool { return slices.Contains(listed(fleet[0].admin), "s5") }, "instance 0 to list s5")
	if slices.Contains(listed(fleet[2].admin), "s5") {
		t.Skip("the 60s instance refreshed already: no skew to test (machine too slow)")
	}
	again := agree("lists differ", keys(0, 100))
	for k, s := range first {
		if again[k] != s {
			t.Errorf("key %s moved from %s to %s when a session was added", k, s, again[k])
		}
	}
	fresh := agree("lists differ, new keys", keys(100, 100))
	onNew := 0
	for _, s := range fresh {
		if s == "s5" {
			onNew++
		}
	}
	// Alone, the instance that lists s5 would send these keys to it and
	// the others could not: that is the disagreement the store prevents.
	if onNew == 0 {
		t.Fatal("no new key went to the new session: the skew was not exercised")
	}
	t.Logf("new keys on the new session: %d of 100", onNew)

	// The session of some keys is rate-limited at the gateway: they all
	// move, together, to sessions that are not it; the others stay.
	all := first
	for k, s := range fresh {
		all[k] = s
	}
	victim := all["crawl-0"]
	fp.SetMode(victim, fakeprovider.Mode429)
	var moved []string
	for k, s := range all {
		if s == victim {
			moved = append(moved, k)
		}
	}
	slices.Sort(moved)
	after := agree("after a cooldown", moved)
	for _, k := range moved {
		if after[k] == victim {
			t.Fatalf("key %s still on the rate-limited %s", k, victim)
		}
	}
	var rest []string
	for k, s := range all {
		if s != victim {
			rest = append(rest, k)
		}
	}
	slices.Sort(rest)
	for k, s := range agree("the others after a cooldown", rest[:min(len(rest), 30)]) {
		if all[k] != s {
			t.Errorf("key %s moved from %s to %s, its session did not cool down", k, all[k], s)
		}
	}
	if !strings.Contains(fmt.Sprint(listed(fleet[2].admin)), "s5") {
		t.Error("the 60s instance never listed the session the fleet bound keys to")
	}
}
