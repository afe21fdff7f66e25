package admin_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/proxy/admin"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

type opsCache struct{ invalidated []string }

func (c *opsCache) Stats() dedup.Stats { return dedup.Stats{} }
func (c *opsCache) InvalidateURL(_ context.Context, u string) (int, error) {
	c.invalidated = append(c.invalidated, u)
	return 1, nil
}
func (c *opsCache) InvalidateKey(context.Context, string) error { return nil }

type opsReloader struct{ n int }

func (r *opsReloader) Reload() (admin.Reload, error) { r.n++; return admin.Reload{}, nil }

// TestAdminRefusesCrossSiteRequests: the admin port as shipped
// (127.0.0.1:9090, no token) refuses state-changing POSTs from web pages
// the operator's browser opens: a "simple" cross-origin request (no CORS
// preflight: text/plain body, Origin of another site) once dropped cache
// entries and reloaded the configuration. And a DNS-rebound page (Host:
// evil.example:9090) cannot read the JSON endpoints.
func TestAdminRefusesCrossSiteRequests(t *testing.T) {
	cache, rel := &opsCache{}, &opsReloader{}
	h := admin.New(admin.Options{CAPEM: []byte("PEM"), Cache: cache, Reloader: rel, LocalOnly: true})

	req := httptest.NewRequest(http.MethodPost, "http://127.0.0.1:9090/cache/invalidate", strings.NewReader(`{"url":"https://example.com/page"}`))
	req.Header.Set("Content-Type", "text/plain")
	req.Header.Set("Origin", "https://evil.example")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code == http.StatusOK || len(cache.invalidated) > 0 {
		t.Errorf("cross-site POST /cache/invalidate: %d, invalidated %v", rec.Code, cache.invalidated)
	}

	req = httptest.NewRequest(http.MethodPost, "http://127.0.0.1:9090/config/reload", nil)
	req.Header.Set("Origin", "https://evil.example")
	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code == http.StatusOK || rel.n > 0 {
		t.Errorf("cross-site POST /config/reload: %d, reloads %d", rec.Code, rel.n)
	}

	req = httptest.NewRequest(http.MethodGet, "http://evil.example:9090/cache/stats", nil)
	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code == http.StatusOK {
		t.Errorf("GET /cache/stats with Host: evil.example:9090 (DNS rebinding): %d", rec.Code)
	}
}

// TestAdminAnswersLocalNamesAndCurl: what the operator sends still works:
// a POST without Origin (curl, scripts) and requests naming localhost or a
// loopback address.
func TestAdminAnswersLocalNamesAndCurl(t *testing.T) {
	cache, rel := &opsCache{}, &opsReloader{}
	h := admin.New(admin.Options{CAPEM: []byte("PEM"), Cache: cache, Reloader: rel, LocalOnly: true})
	for _, host := range []string{"127.0.0.1:9090", "localhost:9090", "[::1]:9090", "localhost"} {
		req := httptest.NewRequest(http.MethodPost, "http://"+host+"/config/reload", nil)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != http.StatusOK {
			t.Errorf("POST /config/reload to %s: %d %s", host, rec.Code, rec.Body)
		}
		req = httptest.NewRequest(http.MethodGet, "http://"+host+"/cache/stats", nil)
		req.Header.Set("Sec-Fetch-Site", "same-origin")
		rec = httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != http.StatusOK {
			t.Errorf("GET /cache/stats on %s: %d", host, rec.Code)
		}
	}
	if rel.n != 4 {
		t.Errorf("%d reloads, want 4", rel.n)
	}
}

// TestBrowserOpensTheStatusPageWithTheToken: with admin.token_env set, a
// browser (which cannot send a bearer token) is challenged for Basic
// credentials and gets the status page with the token as the password;
// a wrong password is refused, and so is a cross-site POST the browser
// would send with the credentials it remembers.
func TestBrowserOpensTheStatusPageWithTheToken(t *testing.T) {
	rel := &opsReloader{}
	h := admin.New(admin.Options{CAPEM: []byte("PEM"), Cache: &opsCache{}, Reloader: rel, Token: "tok"})
	do := func(method, path, user, password, origin string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(method, "http://10.0.0.5:9090"+path, nil)
		if user != "" || password != "" {
			req.SetBasicAuth(user, password)
		}
		if origin != "" {
			req.Header.Set("Origin", origin)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	rec := do(http.MethodGet, "/", "", "", "")
	if rec.Code != http.StatusUnauthorized || !strings.Contains(strings.Join(rec.Header().Values("WWW-Authenticate"), "\n"), "Basic ") {
		t.Fatalf("GET / without credentials: %d, challenges %q; want 401 with a Basic challenge", rec.Code, rec.Header().Values("WWW-Authenticate"))
	}
	if rec := do(http.MethodGet, "/", "operator", "wrong", ""); rec.Code != http.StatusUnauthorized {
		t.Errorf("GET / with a wrong password: %d, want 401", rec.Code)
	}
	if rec := do(http.MethodGet, "/", "operator", "tok", ""); rec.Code != http.StatusOK || !strings.Contains(rec.Header().Get("Content-Type"), "text/html") {
		t.Errorf("GET / with the token as the password: %d %q, want the status page", rec.Code, rec.Header().Get("Content-Type"))
	}
	if rec := do(http.MethodPost, "/config/reload", "operator", "tok", "https://evil.example"); rec.Code == http.StatusOK || rel.n > 0 {
		t.Errorf("cross-site POST with remembered Basic credentials: %d, reloads %d", rec.Code, rel.n)
	}
	if rec := do(http.MethodPost, "/config/reload", "operator", "tok", ""); rec.Code != http.StatusOK || rel.n != 1 {
		t.Errorf("POST /config/reload with Basic credentials: %d, reloads %d", rec.Code, rel.n)
	}
}
