//go:build linux

package dedup

import (
	"net/http"
	"strconv"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
)

// TestDiskTierMakesRoomBeforeItCopies: disk.dir is a volume of exactly
// disk.max_bytes, on another filesystem than spool_dir, so each body is
// copied into the tier. The copy used to come first and the evictions
// after: the directory held max_bytes plus the body meanwhile, and on a
// full volume every copy failed for want of the room its evictions were
// about to free, so nothing new was cached until old entries expired.
func TestDiskTierMakesRoomBeforeItCopies(t *testing.T) {
	const size = 512 << 10
	vol := smallFilesystem(t, 2*size)
	body := pattern(size)
	f := newFixture(t, streamConfig(t, Config{MaxBodyBytes: 64 * bytesize.KiB, Disk: DiskConfig{Dir: vol, MaxBytes: 2 * size}}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(size))
		writeSlowly(w, body)
	}))
	for _, p := range []string{"/a", "/b", "/c"} {
		if r := f.get(p); r.err != nil || r.xcache != CacheMiss || r.body != string(body) {
			t.Fatalf("%s: %s, %d bytes, err %v", p, r.xcache, len(r.body), r.err)
		}
	}
	if r := f.get("/c"); r.err != nil || r.xcache != CacheHit || r.body != string(body) {
		t.Fatalf("/c again: %s, %d bytes, err %v; want a HIT (/a evicted to make room for it)", r.xcache, len(r.body), r.err)
	}
}
