package dedup

import (
	"bytes"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
)

// TestRunDirsRemovedUnderARunningProcess: a tmp cleaner (systemd-tmpfiles,
// an operator's rm -rf) removes the spool and disk-tier directories of a
// process that runs on. Every body that outgrew memory used to fail from
// then on (its spool file could not be made: the clients' connections were
// cut) and nothing big was cached again, until a restart. The directories
// are made again, locked, so that another process's start does not take
// them for a crashed one's.
func TestRunDirsRemovedUnderARunningProcess(t *testing.T) {
	const size = 1 << 20
	body := pattern(size)
	f := newFixture(t, streamConfig(t, Config{MaxBodyBytes: 64 * bytesize.KiB}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(size))
		writeSlowly(w, body)
	}))
	spoolDir, diskDir := f.eng.spools.dir.path, f.eng.disk.dir.path
	for _, dir := range []string{spoolDir, diskDir} {
		if err := os.RemoveAll(dir); err != nil {
			t.Fatal(err)
		}
	}
	if r := f.get("/big"); r.err != nil || r.status != 200 || r.xcache != CacheMiss || r.body != string(body) {
		t.Fatalf("after the directories went: status %d, %s, %d of %d bytes, err %v", r.status, r.xcache, len(r.body), size, r.err)
	}
	if r := f.get("/big"); r.err != nil || r.xcache != CacheHit || r.body != string(body) {
		t.Fatalf("second request: %s, %d of %d bytes, err %v; want a HIT from the disk tier", r.xcache, len(r.body), size, r.err)
	}
	for _, dir := range []string{spoolDir, diskDir} {
		if !lockedByAnother(filepath.Join(dir, "lock")) {
			t.Errorf("%s made again without its lock: another process would remove it as stale", dir)
		}
	}
}

// TestDiskTierEntryWhoseFileWentIsFetchedOnce: the disk tier's file for a
// cached body is gone (its directory removed under the process) while its
// index entry stays. Every request for it used to find the entry, fail to
// open the file and go upstream on its own, uncoalesced (BYPASS), and the
// body was never cached again until the entry expired. Now the entry is
// forgotten when its file cannot be opened: one flight fetches the body
// again and caches it.
func TestDiskTierEntryWhoseFileWentIsFetchedOnce(t *testing.T) {
	const size = 256 << 10
	body := pattern(size)
	f := newFixture(t, streamConfig(t, Config{MaxBodyBytes: 64 * bytesize.KiB}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(size))
		writeSlowly(w, body)
	}))
	if r := f.get("/cached"); r.err != nil || r.xcache != CacheMiss || r.body != string(body) {
		t.Fatalf("first request: %s, %d bytes, err %v", r.xcache, len(r.body), r.err)
	}
	if err := os.RemoveAll(f.eng.disk.dir.path); err != nil {
		t.Fatal(err)
	}
	for i, want := range []string{CacheMiss, CacheHit, CacheHit} {
		if r := f.get("/cached"); r.err != nil || r.xcache != want || r.body != string(body) {
			t.Fatalf("request #%d after the file went: %s, %d of %d bytes, err %v; want %s", i, r.xcache, len(r.body), size, r.err, want)
		}
	}
	if n := f.up.n.Load(); n != 2 {
		t.Fatalf("origin requests = %d, want 2", n)
	}
}

// TestDiskTierEntryWhoseFileWentIsFetchedOnceForRanges: as above, for a
// media player's requests, which all carry Range. A request for bytes=0-
// found the entry, could not open its file and went upstream for the
// whole body on its own, and the entry stayed: every later one did the
// same, and the body was never cached again until a plain GET came or the
// entry expired. Now the first forgets the entry, the next starts a flight
// that caches the body again, and the one after is a HIT.
func TestDiskTierEntryWhoseFileWentIsFetchedOnceForRanges(t *testing.T) {
	const size = 256 << 10
	f, body := cachedOnDisk(t, size)
	if err := os.RemoveAll(f.eng.disk.dir.path); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		r := f.get("/cached", "Range", "bytes=0-")
		if r.err != nil || r.body != string(body) {
			t.Fatalf("range #%d after the file went: %s, %d of %d bytes, err %v", i, r.xcache, len(r.body), size, r.err)
		}
		if i == 2 && r.xcache != CacheHit {
			t.Fatalf("range #%d after the file went: %s, want a HIT (the body cached again)", i, r.xcache)
		}
	}
	if n := f.up.n.Load(); n != 3 {
		t.Fatalf("origin requests = %d, want 3", n)
	}
}

// TestDiskTierEntryWhoseFileWasCutIsFetchedAgain: the disk tier's file
// for a cached body is shorter than the body (truncated under the
// process: an operator freeing space, a disk error). Every hit used to
// declare the whole length and send what the file had, cutting each
// client's connection short of it, until the entry expired. Now a file
// whose size is not the body's is taken for gone.
func TestDiskTierEntryWhoseFileWasCutIsFetchedAgain(t *testing.T) {
	const size = 256 << 10
	f, body := cachedOnDisk(t, size)
	ent := f.eng.disk.get(f.get("/cached").key)
	if ent == nil {
		t.Fatal("not in the disk tier")
	}
	if err := os.Truncate(ent.file.path, size/2); err != nil {
		t.Fatal(err)
	}
	for i, want := range []string{CacheMiss, CacheHit} {
		if r := f.get("/cached"); r.err != nil || r.xcache != want || r.body != string(body) {
			t.Fatalf("request #%d after the file was cut: %s, %d of %d bytes, err %v; want %s", i, r.xcache, len(r.body), size, r.err, want)
		}
	}
	if r := f.get("/cached", "Range", "bytes=0-"); r.err != nil || r.body != string(body) {
		t.Fatalf("range: %s, %d of %d bytes, err %v", r.xcache, len(r.body), size, r.err)
	}
}

// cachedOnDisk starts a fixture whose origin serves a body of size bytes
// (Range answered) at /cached, over max_body_bytes, and fetches it once:
// it is in the disk tier once the download is kept.
func cachedOnDisk(t *testing.T, size int) (*fixture, []byte) {
	t.Helper()
	body := pattern(size)
	f := newFixture(t, streamConfig(t, Config{MaxBodyBytes: 64 * bytesize.KiB}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(body))
	}))
	if r := f.get("/cached"); r.err != nil || r.xcache != CacheMiss || r.body != string(body) {
		t.Fatalf("first request: %s, %d bytes, err %v", r.xcache, len(r.body), r.err)
	}
	return f, body
}
