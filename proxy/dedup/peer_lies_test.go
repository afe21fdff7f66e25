package dedup

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
)

// TestPeerAnswerNotTheWholeBody: a peer answers with its X-Cache-Key but
// not with the whole body the follower asked for: a body ended by closing
// the connection (a cut there looks like its end), a 206 to a GET without
// Range, a 101. The follower cannot take it for the body, so it fetches
// its own copy from the origin, for all its clients: each gets the whole
// body with a 200, never a part of it. A close-delimited part used to
// reach the clients as a complete 200, and be cached; a 206 reached them
// as it was.
func TestPeerAnswerNotTheWholeBody(t *testing.T) {
	body := pattern(1 << 20)
	raw := func(w http.ResponseWriter, head string, b []byte) {
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Error(err)
			return
		}
		defer conn.Close()
		brw.WriteString(head)
		brw.Write(b)
		brw.Flush()
	}
	for _, tc := range []struct {
		name  string
		serve func(w http.ResponseWriter, key string)
	}{
		{"close-delimited", func(w http.ResponseWriter, key string) {
			raw(w, "HTTP/1.1 200 OK\r\nX-Cache-Key: "+key+"\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n\r\n", body[:256<<10])
		}},
		{"206 to a plain GET", func(w http.ResponseWriter, key string) {
			w.Header().Set(HeaderCacheKey, key)
			w.Header().Set("Content-Type", "application/octet-stream")
			w.Header().Set("Content-Range", "bytes 0-99/"+strconv.Itoa(len(body)))
			w.Header().Set("Content-Length", "100")
			w.WriteHeader(http.StatusPartialContent)
			w.Write(body[:100])
		}},
		{"101", func(w http.ResponseWriter, key string) {
			raw(w, "HTTP/1.1 101 Switching Protocols\r\nX-Cache-Key: "+key+"\r\nConnection: Upgrade\r\nUpgrade: x\r\n\r\n", body[:100])
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			release := make(chan struct{})
			var hits atomic.Int64
			origin := heldOrigin(t, body, 128<<10, release, &hits)
			insts := peerFleet(t, 2, origin, Config{MaxBodyBytes: 256 * bytesize.KiB}, func(http.Handler) http.Handler {
				return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					tc.serve(w, strings.TrimPrefix(r.URL.Path, PeerPath))
				})
			})
			// Before the engines close, which waits for their downloads.
			t.Cleanup(func() { closeOnce(release) })
			a, b := insts[0], insts[1]
			leader, err := a.open(context.Background(), origin.URL+"/big")
			if err != nil {
				t.Fatal(err)
			}
			defer leader.Body.Close()
			resp, err := b.open(context.Background(), origin.URL+"/big")
			if err != nil {
				t.Fatal(err)
			}
			got, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != http.StatusOK || !bytes.Equal(got, body) {
				t.Fatalf("follower's client: %d, %d of %d bytes, %v", resp.StatusCode, len(got), len(body), err)
			}
			expectOwnCopy(t, release, leader, body, &hits, b)
		})
	}
}

// TestPeerHandlerRefusesKeysNotOurs: a key of the right length that is not
// lower-case hex after "v1:" (path segments, other bytes) is a malformed
// request, 400, like any other: it never reaches a store lookup as a key,
// and the caller is told its request is wrong rather than that nothing is
// held.
func TestPeerHandlerRefusesKeysNotOurs(t *testing.T) {
	f := newFixture(t, Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	h := f.eng.PeerHandler()
	for _, key := range []string{
		"v1:" + strings.Repeat("../", 21) + "x",
		"v1:" + strings.Repeat("A", 64),
		"v1:" + strings.Repeat("0", 63) + "\x00",
		"v1:" + strings.Repeat("0", 62) + "%2F",
	} {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "http://peer"+PeerPath+url.PathEscape(key), nil))
		if rec.Code != http.StatusBadRequest {
			t.Errorf("key %q: %d, want 400", key, rec.Code)
		}
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "http://peer"+PeerPath+"v1:"+strings.Repeat("0a", 32), nil))
	if rec.Code != http.StatusNotFound {
		t.Errorf("a well-formed key held nowhere: %d, want 404", rec.Code)
	}
}
