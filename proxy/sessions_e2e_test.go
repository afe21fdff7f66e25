package proxy_test

import (
	"context"
	"crypto/x509"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// exitIPOrigin answers with the address the request came from: the exit IP
// of the upstream session that carried it.
func exitIP(r *http.Request) string {
	host, _, _ := net.SplitHostPort(r.RemoteAddr)
	return host
}

// TestRotateAndRetryReachesCoalescedWaiters: the origin rate-limits one exit
// IP. Ten clients ask for the same page through one sticky session; the
// flight gets the 429, the pool rotates the session through the provider
// API and retries on the new exit IP, and every client, the coalesced
// waiters included, gets the 200. The session's state shows it.
func TestRotateAndRetryReachesCoalescedWaiters(t *testing.T) {
	const n = 10
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	s1, _ := fp.Session("s1")
	banned := s1.ExitIP
	var w *world
	var hits atomic.Int64
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		if exitIP(r) == banned {
			// Hold the 429 until every client waits on this flight.
			testkit.Wait(t, testkit.Patience, func() bool { return w.engine.Stats().Waiters == n }, "clients coalesced")
			rw.Header().Set("Retry-After", "1")
			http.Error(rw, "slow down", http.StatusTooManyRequests)
			return
		}
		fmt.Fprintf(rw, "page via %s", exitIP(r))
	}), false)
	w = newWorld(t, worldOpts{
		originCAs: []*x509.Certificate{origin.Certificate()},
		upstream:  upstream.Config{Provider: upstream.ProviderConfig{API: fp.APIURL(), APIKey: fp.APIKey()}},
		dedup:     dedupOn(dedup.Config{}),
	})

	pu := *w.proxyURL
	pu.User = url.UserPassword("acct-session-s1", "x")
	c := w.client(false)
	c.Transport.(*http.Transport).Proxy = http.ProxyURL(&pu)

	var wg sync.WaitGroup
	results := make(chan fetched, n)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results <- fetch(context.Background(), c, origin.URL+"/limited")
		}()
	}
	wg.Wait()
	close(results)
	counts := map[string]int{}
	for r := range results {
		if r.err != nil || r.status != 200 || r.body == "" || r.body == "page via "+banned {
			t.Fatalf("client got %+v", r)
		}
		counts[r.xcache]++
	}
	if counts["MISS"] != 1 || counts["COALESCED"] != n-1 {
		t.Fatalf("X-Cache %v: the waiters did not share the retried answer", counts)
	}
	if hits.Load() != 2 {
		t.Fatalf("origin saw %d requests, want the 429 and the retry", hits.Load())
	}
	if fp.Rotations("s1") < 1 {
		t.Fatal("the rate-limited session was not rotated through the provider API")
	}
	var st upstream.SessionStatus
	for _, s := range w.up.Sessions() {
		if s.ID == "s1" {
			st = s
		}
	}
	if st.Failures < 1 || st.Rotations < 1 || st.Weight >= st.BaseWeight {
		t.Fatalf("/upstream/sessions does not show the 429: %+v", st)
	}
}

// TestStickySessionHintThroughProxy: a session hint in the proxy user name
// keeps every request on one exit IP; another hint uses another session.
func TestStickySessionHintThroughProxy(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 3})
	var mu sync.Mutex
	seen := map[string]map[string]bool{} // hint → exit IPs
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		mu.Lock()
		hint := r.URL.Query().Get("h")
		if seen[hint] == nil {
			seen[hint] = map[string]bool{}
		}
		seen[hint][exitIP(r)] = true
		mu.Unlock()
	}), false)
	w := newWorld(t, worldOpts{
		originCAs: []*x509.Certificate{origin.Certificate()},
		upstream:  upstream.Config{Provider: upstream.ProviderConfig{API: fp.APIURL(), APIKey: fp.APIKey()}},
	})
	for _, hint := range []string{"s1", "s2"} {
		pu := *w.proxyURL
		pu.User = url.UserPassword("acct-session-"+hint, "x")
		c := w.client(false)
		c.Transport.(*http.Transport).Proxy = http.ProxyURL(&pu)
		for i := range 20 {
			resp, _ := w.get(c, fmt.Sprintf("%s/p%d?h=%s", origin.URL, i, hint))
			if resp.StatusCode != 200 || resp.Header.Get("X-Onceproxy-Upstream") != hint {
				t.Fatalf("hint %s: %d via %q", hint, resp.StatusCode, resp.Header.Get("X-Onceproxy-Upstream"))
			}
		}
	}
	if len(seen["s1"]) != 1 || len(seen["s2"]) != 1 {
		t.Fatalf("a sticky hint used several exit IPs: %v", seen)
	}
	for ip := range seen["s1"] {
		if seen["s2"][ip] {
			t.Fatalf("two sessions left from the same exit IP %s", ip)
		}
	}
}
