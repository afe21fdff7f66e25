package dedup

import (
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestDownloadOutlivingItsTTLEvictsNothing: a big body whose download takes
// longer than its TTL (counted from its headers) is stale when complete.
// It used to go into the disk tier all the same, evicting fresh entries to
// make room for one that the next lookup throws away: the fresh object was
// then fetched again.
func TestDownloadOutlivingItsTTLEvictsNothing(t *testing.T) {
	const size = 1 << 20
	body := pattern(size)
	short := 150 * time.Millisecond
	cfg := streamConfig(t, Config{
		MaxBodyBytes: 64 * bytesize.KiB,
		Disk:         DiskConfig{MaxBytes: 3 * size / 2},
		Rules:        []RuleConfig{{Name: "slow", PathPrefix: "/slow", TTL: &short}},
	})
	f := newFixture(t, cfg, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(size))
		if !strings.HasPrefix(r.URL.Path, "/slow") {
			writeSlowly(w, body)
			return
		}
		writeSlowly(w, body[:size/2])
		time.Sleep(3 * short)
		writeSlowly(w, body[size/2:])
	}))
	if r := f.get("/fresh"); r.err != nil || r.body != string(body) || r.xcache != CacheMiss {
		t.Fatalf("fresh: %s %v", r.xcache, r.err)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.flights.running() == 0 }, "the download to end")
	if r := f.get("/slow"); r.err != nil || r.body != string(body) {
		t.Fatalf("slow: %s %v", r.xcache, r.err)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.flights.running() == 0 }, "the download to end")
	if r := f.get("/fresh"); r.err != nil || r.body != string(body) || r.xcache != CacheHit {
		t.Fatalf("fresh again: X-Cache %s, err %v; want a HIT (evicted for a body already stale)", r.xcache, r.err)
	}
	if n := f.up.n.Load(); n != 2 {
		t.Fatalf("upstream requests = %d, want 2", n)
	}
}
