package dedup

import (
	"bytes"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// lyingTransport answers every request with a body of n bytes that claims
// Content-Length declared: a transport below the engine that does not
// enforce the length (net/http and upstream/mirror do).
type lyingTransport struct {
	declared, n int64
	calls       atomic.Int64
}

func (l *lyingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	l.calls.Add(1)
	return &http.Response{
		StatusCode: http.StatusOK, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header:        http.Header{"Content-Type": {"application/octet-stream"}},
		ContentLength: l.declared,
		Body:          io.NopCloser(bytes.NewReader(bytes.Repeat([]byte("x"), int(l.n)))),
		Request:       req,
	}, nil
}

// TestBodyNotItsDeclaredLength: a streamed body (past the 64 KiB read
// whole) that ends short of its Content-Length, or runs past it, fails its
// reader and is not cached: the next request goes upstream again. The
// engine used to take the early end as the end and cache the truncated
// body as the whole answer.
func TestBodyNotItsDeclaredLength(t *testing.T) {
	for _, tc := range []struct {
		name        string
		declared, n int64
	}{{"short", 200 << 10, 100 << 10}, {"long", 100 << 10, 200 << 10}} {
		t.Run(tc.name, func(t *testing.T) {
			up := &lyingTransport{declared: tc.declared, n: tc.n}
			cfg := Config{Enabled: true, TTL: time.Minute}.WithDefaults()
			store := NewMemoryStore(8 << 20)
			defer store.Close()
			eng, err := New(cfg, Options{Store: store, Next: up, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
			if err != nil {
				t.Fatal(err)
			}
			defer eng.Close()
			for i := range 2 {
				req, _ := http.NewRequest(http.MethodGet, "http://example.test/file", nil)
				resp, err := eng.RoundTrip(req)
				if err != nil {
					t.Fatalf("request %d: %v", i+1, err)
				}
				b, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err == nil {
					t.Fatalf("request %d (%s): read %d bytes of a body declaring %d without an error", i+1, resp.Header.Get(HeaderCache), len(b), tc.declared)
				}
				if int64(len(b)) > tc.declared {
					t.Fatalf("request %d: %d bytes past a Content-Length of %d", i+1, len(b), tc.declared)
				}
				if x := resp.Header.Get(HeaderCache); x != CacheMiss {
					t.Fatalf("request %d: X-Cache %s, want MISS (a failed body is never cached)", i+1, x)
				}
				if !strings.Contains(err.Error(), strconv.FormatInt(tc.declared, 10)) {
					t.Errorf("request %d: the error does not say why: %v", i+1, err)
				}
			}
			if c := up.calls.Load(); c != 2 {
				t.Fatalf("%d upstream calls, want 2", c)
			}
		})
	}
}
