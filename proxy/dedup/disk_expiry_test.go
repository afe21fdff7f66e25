package dedup

import (
	"net/http"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestDiskTierExpiredEntryLeavesTheDisk: an entry's file goes when the
// entry expires. It used to stay until a request for its key came or the
// tier needed its room: a proxy done with a crawl kept up to
// disk.max_bytes of bodies nobody could be served, for as long as it ran.
func TestDiskTierExpiredEntryLeavesTheDisk(t *testing.T) {
	dir, err := openRunDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	d := newDiskTier(dir, 1000)
	defer d.close()
	meta := &Entry{Status: 200, Header: http.Header{}, StoredAt: time.Now(), ExpiresAt: time.Now().Add(50 * time.Millisecond)}
	if err := d.putBytes("a", meta, make([]byte, 100)); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 2*time.Second, func() bool {
		st := d.stats()
		return st.Entries == 0 && st.Bytes == 0 && dir.files() == 0
	}, "the expired entry's file to go (stats %+v, %d files)", d.stats(), dir.files())
}
