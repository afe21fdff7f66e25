package dedup

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"strconv"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestHeadFromTheDownload: HEADs of a URL whose big body is downloading
// get the download's head (200, its Content-Length, COALESCED) without a
// request upstream of their own, and count no body bytes as saved. Once it
// is cached, a HEAD is a HIT, again without its body counted.
func TestHeadFromTheDownload(t *testing.T) {
	const size = 1 << 20
	body := pattern(size)
	gate := testkit.NewGate(t)
	var heads int
	f := newFixture(t, streamConfig(t, Config{MaxBodyBytes: 64 * bytesize.KiB}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(size))
		w.Header().Set("Content-Type", "video/mp4")
		if r.Method == http.MethodHead {
			heads++
			return
		}
		writeSlowly(w, body[:256<<10])
		gate.Wait(r.Context())
		writeSlowly(w, body[256<<10:])
	}))
	leader, err := f.open(context.Background(), "/movie")
	if err != nil {
		t.Fatal(err)
	}
	defer leader.Body.Close()
	before := f.eng.Stats()
	for i := range 3 {
		r := f.do(context.Background(), http.MethodHead, "/movie", nil, "")
		if r.err != nil || r.status != 200 || r.xcache != CacheCoalesced || r.body != "" ||
			r.header.Get("Content-Length") != strconv.Itoa(size) || r.header.Get("Content-Type") != "video/mp4" {
			t.Fatalf("HEAD %d during the download: %d %s, Content-Length %q, %d body bytes, err %v",
				i, r.status, r.xcache, r.header.Get("Content-Length"), len(r.body), r.err)
		}
	}
	if got := f.eng.Stats(); got.BytesAvoided != before.BytesAvoided {
		t.Errorf("HEADs counted %d body bytes as saved, want none", got.BytesAvoided-before.BytesAvoided)
	}
	gate.Open()
	if all, err := io.ReadAll(leader.Body); err != nil || !bytes.Equal(all, body) {
		t.Fatalf("leader: %d bytes, %v", len(all), err)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.flights.running() == 0 }, "the download to end")
	before = f.eng.Stats()
	if r := f.do(context.Background(), http.MethodHead, "/movie", nil, ""); r.status != 200 || r.xcache != CacheHit {
		t.Fatalf("HEAD once cached: %d %s", r.status, r.xcache)
	}
	if got := f.eng.Stats(); got.BytesAvoided != before.BytesAvoided {
		t.Errorf("a HEAD answered from the cached GET counted %d body bytes as saved, want none", got.BytesAvoided-before.BytesAvoided)
	}
	if n := f.up.n.Load(); n != 1 || heads != 0 {
		t.Fatalf("origin requests = %d (%d HEADs), want the one GET", n, heads)
	}
}
