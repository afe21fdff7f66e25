//go:build linux

package dedup

import (
	"crypto/sha256"
	"io"
	"net/http"
	"strconv"
	"syscall"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// smallFilesystem mounts a tmpfs of size bytes for the test, or skips it
// where mounting is not allowed (no CAP_SYS_ADMIN).
func smallFilesystem(t *testing.T, size int) string {
	t.Helper()
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size="+strconv.Itoa(size)); err != nil {
		t.Skipf("cannot mount a small filesystem to fill: %v", err)
	}
	t.Cleanup(func() { syscall.Unmount(dir, syscall.MNT_DETACH) })
	return dir
}

// TestSpoolDiskFullRelaysTheBody: the spool directory's filesystem fills
// up in the middle of a big body. Every client reading it used to get its
// connection cut (the spool's write failed the download). Now the download
// goes on as a relay to the clients already reading it, at the pace of the
// slowest, and is not cached; the next request starts a flight of its own.
func TestSpoolDiskFullRelaysTheBody(t *testing.T) {
	const n, size = 3, 1 << 20
	full := smallFilesystem(t, 256<<10) // before the engine: unmounted after its Close
	body := pattern(size)
	want := sha256.Sum256(body)
	var f *fixture
	f = newFixture(t, streamConfig(t, Config{MaxBodyBytes: 64 * bytesize.KiB, SpoolDir: full}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("first") != "" {
			// Every reader on the flight before the first byte.
			if !testkit.Wait(t, testkit.Patience, func() bool { return f.eng.Stats().Waiters == n }, "%d waiters", n) {
				return
			}
		}
		w.Header().Set("Content-Length", strconv.Itoa(size))
		writeSlowly(w, body)
	}))
	type got struct {
		xcache string
		sum    [32]byte
		n      int
		err    error
	}
	out := make(chan got, n)
	for range n {
		go func() {
			resp, err := f.open(t.Context(), "/big?first=1")
			if err != nil {
				out <- got{err: err}
				return
			}
			defer resp.Body.Close()
			b, err := io.ReadAll(resp.Body)
			out <- got{xcache: resp.Header.Get(HeaderCache), sum: sha256.Sum256(b), n: len(b), err: err}
		}()
	}
	counts := map[string]int{}
	for range n {
		g := <-out
		if g.err != nil || g.sum != want {
			t.Fatalf("a reader got %d of %d bytes (%s), err %v", g.n, size, g.xcache, g.err)
		}
		counts[g.xcache]++
	}
	if counts[CacheMiss] != 1 || counts[CacheCoalesced] != n-1 {
		t.Fatalf("X-Cache %v, want one MISS and %d COALESCED", counts, n-1)
	}
	// Not cached: the next request fetches again, and gets it whole too.
	if r := f.get("/big"); r.err != nil || r.xcache != CacheMiss || r.body != string(body) {
		t.Fatalf("next request: %s, %d bytes, err %v", r.xcache, len(r.body), r.err)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.Stats().Spool.Active == 0 }, "every spool let go")
	if n, _ := files(t, full); n != 0 {
		t.Fatalf("%d spool files left on the full filesystem", n)
	}
}
