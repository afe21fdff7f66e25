package app

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestHealthSaysNoSessionsYet: an instance whose provider refused the
// first session list (429, Retry-After: 3600) answers every request 503,
// and /health said "ok" and nothing else. /health says the instance has
// no upstream sessions yet and when the API is asked again (at most
// upstream.MaxFirstListWait away, whatever the Retry-After), and the
// clients' 503 says the same, with a Retry-After to match.
func TestHealthSaysNoSessionsYet(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2, APIRetryAfter: 3600})
	fp.SetAPIMode(fakeprovider.API429)
	a := serveApp(t, "", []string{"ONCEPROXY_UPSTREAM_PROVIDER_API=" + fp.APIURL(), "ONCEPROXY_UPSTREAM_PROVIDER_API_KEY=" + fp.APIKey()})

	res, err := http.Get("http://" + a.Addrs().Admin + "/health")
	if err != nil {
		t.Fatal(err)
	}
	var health map[string]any
	err = json.NewDecoder(res.Body).Decode(&health)
	res.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	next, _ := time.ParseDuration(stringOf(health["upstream_next_try_in"]))
	if res.StatusCode != http.StatusOK || health["upstream"] != "no_sessions_yet" || next <= 0 || next > upstream.MaxFirstListWait {
		t.Errorf("/health: %d %v, want 200 saying no_sessions_yet and the next try within %s", res.StatusCode, health, upstream.MaxFirstListWait)
	}

	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "page") }))
	defer origin.Close()
	c := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: a.Addrs().Proxy})}}
	defer c.CloseIdleConnections()
	resp, err := c.Get(origin.URL + "/a")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	ra, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "next try in") ||
		ra <= 0 || time.Duration(ra)*time.Second > upstream.MaxFirstListWait {
		t.Errorf("a request: %d Retry-After %q %q, want 503 naming the next try, Retry-After within %s",
			resp.StatusCode, resp.Header.Get("Retry-After"), body, upstream.MaxFirstListWait)
	}
}

func stringOf(v any) string {
	s, _ := v.(string)
	return s
}
