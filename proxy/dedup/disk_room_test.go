//go:build linux

package dedup

import (
	"net/http"
	"strconv"
	"testing"
	"time"

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

// TestDiskTierMakesRoomBeforeItWritesABody: the same for a body the tier
// gets in memory (bigger than the shared store takes, within
// max_body_bytes), which it writes to a file of its own.
func TestDiskTierMakesRoomBeforeItWritesABody(t *testing.T) {
	const size = 512 << 10
	dir, err := openRunDir(smallFilesystem(t, 2*size))
	if err != nil {
		t.Fatal(err)
	}
	d := newDiskTier(dir, 2*size)
	defer d.close()
	meta := &Entry{Status: 200, Header: http.Header{}, StoredAt: time.Now(), ExpiresAt: time.Now().Add(time.Hour)}
	for _, k := range []string{"a", "b", "c"} {
		if err := d.putBytes(k, meta, pattern(size)); err != nil {
			t.Fatalf("%s: %v", k, err)
		}
	}
	if d.get("c") == nil || d.get("a") != nil {
		t.Fatal("c not cached in a's room")
	}
}
