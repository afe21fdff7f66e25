package proxy_test

import (
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/netguard"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestFetchAPI: GET /fetch?url= on the proxy port is the API form of the
// caching proxy: it goes through the same pipeline (auth with
// Proxy-Authorization or Authorization: Basic, dedup, the guard), shares
// the cache with proxy-form requests, forwards the client's other headers
// but not the credentials it used for the proxy, and refuses bad input with
// a reason.
func TestFetchAPI(t *testing.T) {
	var hits atomic.Int64
	var lastAuth, lastUA atomic.Value
	origin := plainOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		lastAuth.Store(r.Header.Get("Authorization"))
		lastUA.Store(r.Header.Get("User-Agent"))
		io.WriteString(w, "page "+r.URL.RequestURI())
	}))
	w := newWorld(t, worldOpts{dedup: dedupOn(dedup.Config{}), users: testUsers()})
	fetch := func(target string, hdr ...string) (*http.Response, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, "http://"+w.proxyURL.Host+"/fetch?url="+url.QueryEscape(target), nil)
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		resp, err := http.DefaultTransport.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	basic := func(user, pass string) string {
		r, _ := http.NewRequest(http.MethodGet, "http://x", nil)
		r.SetBasicAuth(user, pass)
		return r.Header.Get("Authorization")
	}
	page := origin.URL + "/a?b=1"

	resp, body := fetch(page, "Authorization", basic("alice", "right"), "User-Agent", "sheets/1")
	if resp.StatusCode != 200 || body != "page /a?b=1" || resp.Header.Get("X-Cache") != "MISS" ||
		!strings.HasPrefix(resp.Header.Get("X-Cache-Key"), "v1:") || resp.Header.Get("X-Onceproxy-Upstream") != "direct" {
		t.Fatalf("first fetch: %d %q %v", resp.StatusCode, body, resp.Header)
	}
	if lastAuth.Load() != "" || lastUA.Load() != "sheets/1" {
		t.Errorf("origin saw Authorization %q and User-Agent %q: the proxy's credentials must not pass, the rest must", lastAuth.Load(), lastUA.Load())
	}
	key := resp.Header.Get("X-Cache-Key")
	if resp, _ := fetch(page, "Proxy-Authorization", basic("alice", "right"), "User-Agent", "other/2"); resp.Header.Get("X-Cache") != "HIT" || resp.Header.Get("X-Cache-Key") != key {
		t.Fatalf("second fetch: %s %s, want a HIT on %s", resp.Header.Get("X-Cache"), resp.Header.Get("X-Cache-Key"), key)
	}
	// The same URL in proxy form, by the same account: the same entry.
	if resp, _ := w.get(w.clientAs("alice", "right"), page); resp.Header.Get("X-Cache") != "HIT" || resp.Header.Get("X-Cache-Key") != key {
		t.Fatalf("proxy form: %s %s, want a HIT on %s", resp.Header.Get("X-Cache"), resp.Header.Get("X-Cache-Key"), key)
	}
	if n := hits.Load(); n != 1 {
		t.Errorf("origin hit %d times, want 1", n)
	}

	for _, tc := range []struct {
		name, target, auth string
		status             int
		reason             string
	}{
		{"no credentials", page, "", 407, "proxy credentials required"},
		{"wrong password", page, basic("alice", "wrong"), 407, "proxy credentials required"},
		{"missing url", "", basic("alice", "right"), 400, "missing url parameter"},
		{"relative url", "/a", basic("alice", "right"), 400, "not an absolute URL"},
		{"ftp", "ftp://example.test/x", basic("alice", "right"), 400, "is not http or https"},
		{"no host", "http:///x", basic("alice", "right"), 400, "has no host"},
	} {
		u := "http://" + w.proxyURL.Host + "/fetch"
		if tc.target != "" {
			u += "?url=" + url.QueryEscape(tc.target)
		}
		req, _ := http.NewRequest(http.MethodGet, u, nil)
		if tc.auth != "" {
			req.Header.Set("Authorization", tc.auth)
		}
		resp, err := http.DefaultTransport.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.status || !strings.Contains(string(b), tc.reason) {
			t.Errorf("%s: %d %q, want %d with %q", tc.name, resp.StatusCode, b, tc.status, tc.reason)
		}
	}
	// Other paths keep their answer.
	if resp, body := fetchRaw(t, "http://"+w.proxyURL.Host+"/other"); resp.StatusCode != 400 || !strings.Contains(body, "forward proxy") {
		t.Errorf("/other: %d %q", resp.StatusCode, body)
	}

	// The SSRF guard applies: with loopback not allowed, the origin (and
	// every odd spelling of it) is refused before anything is dialled.
	g := newWorld(t, worldOpts{guard: &netguard.Config{}})
	for _, target := range []string{origin.URL + "/x", "http://0x7f.1/", "http://2130706433/", "http://localhost./"} {
		resp, body := fetchRaw(t, "http://"+g.proxyURL.Host+"/fetch?url="+url.QueryEscape(target))
		if resp.StatusCode != 403 || resp.Header.Get("X-Onceproxy-Error") != "forbidden_target" {
			t.Errorf("%s through /fetch with the guard on: %d %q", target, resp.StatusCode, body)
		}
	}
	if n := hits.Load(); n != 1 {
		t.Errorf("origin hit %d times after refused fetches, want 1", n)
	}
}

func fetchRaw(t *testing.T, u string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, u, nil)
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// TestNoPprofOnTheProxyPort: the profiler is an admin endpoint only; the
// proxy port answers an origin-form request for it as for any other path.
func TestNoPprofOnTheProxyPort(t *testing.T) {
	w := newWorld(t, worldOpts{})
	if resp, body := fetchRaw(t, "http://"+w.proxyURL.Host+"/debug/pprof/"); resp.StatusCode != 400 || !strings.Contains(body, "forward proxy") {
		t.Fatalf("/debug/pprof/ on the proxy port: %d %q", resp.StatusCode, body)
	}
}
