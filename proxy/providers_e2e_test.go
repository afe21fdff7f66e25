package proxy_test

import (
	"context"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// inRange reports whether ip is 127.0.0.lo … 127.0.0.hi.
func inRange(ip string, lo, hi byte) bool {
	a, err := netip.ParseAddr(ip)
	if err != nil || !a.Is4() {
		return false
	}
	b := a.As4()
	return b[0] == 127 && b[1] == 0 && b[2] == 0 && b[3] >= lo && b[3] <= hi
}

// twoProvidersConfig starts a primary (priority 10, exit IPs
// 127.0.0.2-19) and a secondary (priority 5, 127.0.0.20-39).
func twoProvidersConfig(t *testing.T, po, so fakeprovider.Options) (*fakeprovider.Provider, *fakeprovider.Provider, upstream.Config) {
	po.ExitIPs, so.ExitIPs = [2]byte{2, 19}, [2]byte{20, 39}
	pri, sec := fakeprovider.Start(t, po), fakeprovider.Start(t, so)
	return pri, sec, upstream.Config{Providers: []upstream.ProviderConfig{
		{Name: "primary", API: pri.APIURL(), APIKey: pri.APIKey(), Priority: 10},
		{Name: "secondary", API: sec.APIURL(), APIKey: sec.APIKey(), Priority: 5},
	}}
}

// TestFailoverReachesCoalescedWaiters: the origin rate-limits every exit
// IP of the primary provider. Ten clients ask for one page at once; the
// flight gets 429s from both primary sessions (rotating them does not
// help), fails over to the secondary inside the same flight, and every
// client, the coalesced waiters included, gets the secondary's 200. The
// 429s speak of the primary's exit IPs at that site: its sessions sit the
// site out, and the primary stays available for every other one.
func TestFailoverReachesCoalescedWaiters(t *testing.T) {
	const n = 10
	var w *world
	var hits, limited atomic.Int64
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		if ip := exitIP(r); inRange(ip, 2, 19) {
			if limited.Add(1) == 1 {
				testkit.Wait(t, testkit.Patience, func() bool { return w.engine.Stats().Waiters == n }, "clients coalesced")
			}
			http.Error(rw, "slow down", http.StatusTooManyRequests)
			return
		}
		fmt.Fprintf(rw, "page via %s", exitIP(r))
	}), false)
	_, _, cfg := twoProvidersConfig(t, fakeprovider.Options{Sessions: 2}, fakeprovider.Options{Sessions: 2})
	w = newWorld(t, worldOpts{
		originCAs: []*x509.Certificate{origin.Certificate()},
		upstream:  cfg,
		dedup:     dedupOn(dedup.Config{}),
	})
	c := w.client(false)
	var wg sync.WaitGroup
	results := make(chan fetched, n)
	for range n {
		wg.Go(func() { results <- fetch(context.Background(), c, origin.URL+"/limited") })
	}
	wg.Wait()
	close(results)
	counts := map[string]int{}
	for r := range results {
		if r.err != nil || r.status != 200 || !strings.HasPrefix(r.body, "page via 127.0.0.") {
			t.Fatalf("client got %+v", r)
		}
		counts[r.xcache]++
	}
	if counts["MISS"] != 1 || counts["COALESCED"] != n-1 {
		t.Fatalf("X-Cache %v: the waiters did not share the failed-over answer", counts)
	}
	if limited.Load() != 2 || hits.Load() != 3 {
		t.Fatalf("origin saw %d requests (%d rate-limited), want both primary sessions' 429 and the secondary's 200", hits.Load(), limited.Load())
	}
	var primary upstream.ProviderStatus
	for _, ps := range w.up.Providers() {
		if ps.Name == "primary" {
			primary = ps
		}
	}
	if !primary.Available || primary.Failovers != 0 {
		t.Fatalf("primary after one site's 429s: %+v, want it available for the other sites", primary)
	}
	site := strings.TrimPrefix(origin.URL, "https://")
	for _, st := range w.up.Sessions() {
		if st.Provider != "primary" {
			continue
		}
		if !slices.ContainsFunc(st.CoolingSites, func(c upstream.SiteCooldown) bool { return c.Host == site && c.Reason == "rate_limited" }) {
			t.Errorf("primary session %s does not sit out %s: %+v", st.ID, site, st)
		}
	}
}

// TestCountryThroughProxy: alice-country-de always exits from a DE
// session (the origin sees its exit address); answers are cached per
// country; a country no session is in is a 503 naming it; a code that is
// no country is a 400; the header never reaches the origin.
func TestCountryThroughProxy(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 4, Countries: []string{"us", "de", "us", "de"}})
	de := map[string]bool{}
	for _, id := range []string{"s2", "s4"} {
		s, _ := fp.Session(id)
		de[s.ExitIP] = true
	}
	var leaked atomic.Bool
	var hits atomic.Int64
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		leaked.Store(leaked.Load() || r.Header.Get("X-Onceproxy-Country") != "")
		fmt.Fprintf(rw, "%s", exitIP(r))
	}), false)
	w := newWorld(t, worldOpts{
		originCAs: []*x509.Certificate{origin.Certificate()},
		upstream:  upstream.Config{Provider: upstream.ProviderConfig{API: fp.APIURL(), APIKey: fp.APIKey()}},
		dedup:     dedupOn(dedup.Config{}),
	})
	as := func(user string) *http.Client {
		c := w.client(false)
		pu := *w.proxyURL
		pu.User = url.UserPassword(user, "x")
		c.Transport.(*http.Transport).Proxy = http.ProxyURL(&pu)
		return c
	}
	getAs := func(c *http.Client, path string, hdr ...string) (*http.Response, string) {
		t.Helper()
		return w.get(c, origin.URL+path, hdr...)
	}
	deClient := as("alice-country-de")
	for i := range 10 {
		resp, body := getAs(deClient, fmt.Sprintf("/p%d", i))
		if resp.StatusCode != 200 || !de[body] {
			t.Fatalf("request %d as alice-country-de exited from %q (%d), want a DE session", i, body, resp.StatusCode)
		}
	}
	// Per country in the cache: DE, then US, then DE again.
	r1, b1 := getAs(deClient, "/geo")
	r2, b2 := getAs(as("alice-country-us"), "/geo")
	r3, b3 := getAs(deClient, "/geo")
	r4, b4 := getAs(as("alice"), "/geo", "X-Onceproxy-Country", "US")
	if r1.Header.Get("X-Cache") != "MISS" || r2.Header.Get("X-Cache") != "MISS" || de[b2] ||
		r3.Header.Get("X-Cache") != "HIT" || b3 != b1 || r4.Header.Get("X-Cache") != "HIT" || b4 != b2 {
		t.Fatalf("per-country cache: DE %s %q, US %s %q, DE %s %q, US by header %s %q",
			r1.Header.Get("X-Cache"), b1, r2.Header.Get("X-Cache"), b2, r3.Header.Get("X-Cache"), b3, r4.Header.Get("X-Cache"), b4)
	}
	if r1.Header.Get("X-Cache-Key") == r2.Header.Get("X-Cache-Key") {
		t.Error("DE and US share a cache key")
	}
	if leaked.Load() {
		t.Error("X-Onceproxy-Country reached the origin")
	}

	resp, body := getAs(as("alice-country-fr"), "/fr")
	if resp.StatusCode != 503 || !strings.Contains(body, "country FR") {
		t.Fatalf("no FR session: %d %q", resp.StatusCode, body)
	}
	// A bad country is refused on the CONNECT (HTTPS) and on plain requests.
	c := as("alice-country-xx")
	if _, err := c.Get(origin.URL + "/"); err == nil || !strings.Contains(err.Error(), "Bad Request") {
		t.Fatalf("CONNECT as alice-country-xx: %v", err)
	}
	plain := plainOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) { io.WriteString(rw, "x") }))
	resp, body = w.get(c, plain.URL+"/")
	if resp.StatusCode != 400 || resp.Header.Get("X-Onceproxy-Error") != "bad_country" || !strings.Contains(body, "ISO 3166-1") {
		t.Fatalf("plain request as alice-country-xx: %d %q %q", resp.StatusCode, resp.Header.Get("X-Onceproxy-Error"), body)
	}
}

// TestSavingsPricedPerProvider: a HIT saves what its session's provider
// bills (its own price, not the savings section's, which is zero here).
func TestSavingsPricedPerProvider(t *testing.T) {
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) { io.WriteString(rw, "page") }), false)
	_, _, cfg := twoProvidersConfig(t, fakeprovider.Options{Sessions: 1}, fakeprovider.Options{Sessions: 1})
	perReq := 2000.0 // 2 per request
	cfg.Providers[0].PricePer1000Requests = &perReq
	w := newWorld(t, worldOpts{
		originCAs: []*x509.Certificate{origin.Certificate()},
		upstream:  cfg,
		dedup:     dedupOn(dedup.Config{}),
	})
	c := w.client(false)
	if r := fetch(context.Background(), c, origin.URL+"/p"); r.xcache != "MISS" {
		t.Fatalf("first: %+v", r)
	}
	for range 3 {
		if r := fetch(context.Background(), c, origin.URL+"/p"); r.xcache != "HIT" {
			t.Fatalf("again: %+v", r)
		}
	}
	if got := w.engine.Stats().MoneySaved; got < 5.99 || got > 6.01 {
		t.Fatalf("3 HITs of the primary's page saved %v, want 6 (its price per request)", got)
	}
}
