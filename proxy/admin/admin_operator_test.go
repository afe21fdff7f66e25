package admin_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/proxy/admin"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestPublicEndpointsTakeHEAD: /health and /ca.pem never need the token,
// whatever the method a health checker uses (HAProxy's "option httpchk
// HEAD /health", curl -I). HEAD used to get 401 once a token was set.
func TestPublicEndpointsTakeHEAD(t *testing.T) {
	srv := httptest.NewServer(admin.New(admin.Options{CAPEM: []byte("PEM"), Token: "tok"}))
	defer srv.Close()
	for _, path := range []string{"/health", "/ca.pem"} {
		resp, err := http.Head(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("HEAD %s without the token: %d, want 200", path, resp.StatusCode)
		}
	}
	// Anything else on them still needs the token.
	resp, err := http.Post(srv.URL+"/health", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("POST /health without the token: %d, want 401", resp.StatusCode)
	}
}

// recordingCache records the invalidations asked for.
type recordingCache struct{ urls, keys []string }

func (c *recordingCache) Stats() dedup.Stats { return dedup.Stats{} }
func (c *recordingCache) InvalidateURL(_ context.Context, u string) (int, error) {
	c.urls = append(c.urls, u)
	return 1, nil
}
func (c *recordingCache) InvalidateKey(_ context.Context, k string) error {
	c.keys = append(c.keys, k)
	return nil
}

// TestInvalidateBody: POST /cache/invalidate takes exactly one JSON
// object. A body past the limit is 413, not a truncated document
// ("unexpected EOF"); a body with more after the object (a second
// object, NDJSON) is 400 and invalidates nothing, instead of acting on
// the first object alone and answering 200.
func TestInvalidateBody(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		want       int
		wantErr    string
		invalidate bool
	}{
		{name: "one object", body: `{"url": "https://example.com/a"}`, want: 200, invalidate: true},
		{name: "trailing newline", body: "{\"key\": \"v1:ab\"}\n", want: 200, invalidate: true},
		{name: "two objects", body: `{"url": "https://example.com/a"} {"url": "https://example.com/b"}`, want: 400, wantErr: "one JSON object"},
		{name: "trailing garbage", body: `{"url": "https://example.com/a"}]`, want: 400, wantErr: "one JSON object"},
		{name: "too big", body: `{"url": "https://example.com/?q=` + strings.Repeat("a", 100<<10) + `"}`, want: 413, wantErr: "64 KiB"},
		{name: "too big after the object", body: `{"url": "https://example.com/a"}` + strings.Repeat(" ", 100<<10) + "1", want: 413, wantErr: "64 KiB"},
		{name: "not JSON", body: `url=https://example.com/`, want: 400, wantErr: "body must be JSON"},
		{name: "empty", body: ``, want: 400, wantErr: "body must be JSON"},
		{name: "unknown field", body: `{"uri": "https://example.com/"}`, want: 400, wantErr: "uri"},
		{name: "both", body: `{"url": "https://example.com/", "key": "v1:ab"}`, want: 400, wantErr: "exactly one"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cache := &recordingCache{}
			srv := httptest.NewServer(admin.New(admin.Options{Cache: cache}))
			defer srv.Close()
			resp, err := http.Post(srv.URL+"/cache/invalidate", "application/json", strings.NewReader(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var body map[string]any
			b, _ := io.ReadAll(resp.Body)
			if err := json.Unmarshal(b, &body); err != nil {
				t.Fatalf("answer is not JSON: %q", b)
			}
			if resp.StatusCode != tc.want {
				t.Errorf("%d %s, want %d", resp.StatusCode, b, tc.want)
			}
			if msg, _ := body["error"].(string); !strings.Contains(msg, tc.wantErr) {
				t.Errorf("error %q lacks %q", msg, tc.wantErr)
			}
			if did := len(cache.urls)+len(cache.keys) > 0; did != tc.invalidate {
				t.Errorf("invalidated %v %v, want invalidation %v", cache.urls, cache.keys, tc.invalidate)
			}
		})
	}
}
