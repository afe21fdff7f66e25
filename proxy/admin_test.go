package proxy_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/proxy"
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
