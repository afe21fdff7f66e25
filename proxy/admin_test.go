package proxy_test

import (
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"html"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

func TestAdminToken(t *testing.T) {
	admin := httptest.NewServer(proxy.NewAdmin(proxy.AdminOptions{
		CAPEM:   []byte("PEM"),
		Token:   "s3cret-token",
		Metrics: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "metrics") }),
	}))
	defer admin.Close()
	get := func(path, auth string) int {
		req, _ := http.NewRequest(http.MethodGet, admin.URL+path, nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, tc := range []struct {
		path, auth string
		want       int
	}{
		{"/health", "", 200},
		{"/ca.pem", "", 200},
		{"/metrics", "", 401},
		{"/metrics", "Bearer wrong", 401},
		{"/metrics", "Basic s3cret-token", 401},
		{"/metrics", "Bearer s3cret-token", 200},
		{"/nope", "Bearer s3cret-token", 404},
	} {
		if got := get(tc.path, tc.auth); got != tc.want {
			t.Errorf("GET %s with %q: %d, want %d", tc.path, tc.auth, got, tc.want)
		}
	}
	resp, _ := http.Get(admin.URL + "/metrics")
	if !strings.Contains(resp.Header.Get("WWW-Authenticate"), "Bearer") {
		t.Error("401 without a Bearer challenge")
	}
	resp.Body.Close()
}

func TestStatusPage(t *testing.T) {
	origin := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, dedup: dedupOn(dedup.Config{})})
	c := w.client(false)
	w.get(c, origin.URL+"/a")
	w.get(c, origin.URL+"/a")
	admin := httptest.NewServer(proxy.NewAdmin(proxy.AdminOptions{
		CAPEM: w.ca.CertPEM(),
		Cache: w.engine,
		Sessions: func() ([]proxy.SessionView, string) {
			return []proxy.SessionView{{ID: "s1", Proxy: "http://u:xxxxx@gw:8000", Rotation: "sticky", Weight: 3, BaseWeight: 5, Cooldown: "41s"}}, "pool"
		},
	}))
	defer admin.Close()
	resp, err := http.Get(admin.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	// html/template escapes '+' in text; what a reader copies is unescaped.
	page := html.UnescapeString(string(b))
	sum := sha256.Sum256(w.ca.Certificate().RawSubjectPublicKeyInfo)
	for _, want := range []string{
		`<b id="savings">50%</b>`, `<b id="hit">1</b>`, `<b id="miss">1</b>`, "cooling 41s",
		base64.StdEncoding.EncodeToString(sum[:]), `href="/ca.pem"`,
	} {
		if !strings.Contains(page, want) {
			t.Errorf("status page lacks %q", want)
		}
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/html") {
		t.Errorf("Content-Type %q", ct)
	}
	if resp, _ := http.Get(admin.URL + "/nope"); resp.StatusCode != 404 {
		t.Errorf("unknown path: %d", resp.StatusCode)
	}
}
