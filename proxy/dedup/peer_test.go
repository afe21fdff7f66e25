package dedup

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestPeerHandlerServesHeldBodies: another instance reads, from the peer
// handler, a body this one is still downloading (bytes as they come) and
// then the cached copy, stored bytes and headers intact; unknown keys are
// 404, malformed ones 400; the origin is asked once. The origin sends no
// Content-Type, and the peer handler adds none (net/http would sniff one).
func TestPeerHandlerServesHeldBodies(t *testing.T) {
	body := pattern(2 << 20)
	release := make(chan struct{})
	f := newFixture(t, streamConfig(t, Config{MaxBodyBytes: 64 * bytesize.KiB}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.Header().Set("X-Origin", "yes")
		w.Header()["Content-Type"] = nil
		writeSlowly(w, body[:128<<10])
		<-release
		writeSlowly(w, body[128<<10:])
	}))
	peer := httptest.NewServer(f.eng.PeerHandler())
	defer peer.Close()
	leader, err := f.open(context.Background(), "/big")
	if err != nil {
		t.Fatal(err)
	}
	defer leader.Body.Close()
	key := leader.Header.Get(HeaderCacheKey)

	resp, err := http.Get(peer.URL + PeerPath + key)
	if err != nil {
		t.Fatal(err)
	}
	head := make([]byte, 64<<10)
	if _, err := io.ReadFull(resp.Body, head); err != nil || !bytes.Equal(head, body[:len(head)]) {
		t.Fatalf("peer's first bytes while the origin holds the rest: %v", err)
	}
	close(release)
	rest, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if _, typed := resp.Header["Content-Type"]; err != nil || !bytes.Equal(append(head, rest...), body) || resp.Header.Get("X-Origin") != "yes" || resp.Header.Get(HeaderCache) != CacheCoalesced || typed {
		t.Fatalf("in flight: %d bytes, %v, header %v", len(head)+len(rest), err, resp.Header)
	}
	io.Copy(io.Discard, leader.Body)
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.flights.running() == 0 }, "the download to end")

	for _, tc := range []struct {
		rng     string
		status  int
		want    []byte
		xcache  string
		cLength string
	}{
		{"", 200, body, CacheHit, strconv.Itoa(len(body))},
		{"bytes=100-199", 206, body[100:200], CacheHit, "100"},
	} {
		req, _ := http.NewRequest(http.MethodGet, peer.URL+PeerPath+key, nil)
		if tc.rng != "" {
			req.Header.Set("Range", tc.rng)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		_, typed := resp.Header["Content-Type"]
		if err != nil || resp.StatusCode != tc.status || !bytes.Equal(b, tc.want) || resp.Header.Get(HeaderCache) != tc.xcache || resp.Header.Get("Content-Length") != tc.cLength || typed {
			t.Fatalf("cached %q: %d %s CL %s, %d bytes, %v, header %v", tc.rng, resp.StatusCode, resp.Header.Get(HeaderCache), resp.Header.Get("Content-Length"), len(b), err, resp.Header)
		}
	}
	for path, status := range map[string]int{
		PeerPath + "v1:" + string(bytes.Repeat([]byte("0"), 64)): http.StatusNotFound,
		PeerPath + "nope": http.StatusBadRequest,
		"/elsewhere":      http.StatusBadRequest,
	} {
		resp, err := http.Get(peer.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != status {
			t.Errorf("%s: %d, want %d", path, resp.StatusCode, status)
		}
	}
	if n := f.up.n.Load(); n != 1 {
		t.Fatalf("origin requests = %d", n)
	}
}
