package dedup

import (
	"context"
	"errors"
	"net/http"
	"os"
	"strconv"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestSpoolFilesStayWithinTheirDiskBound: spool files together hold at
// most spool_disk_bytes. Nothing bounded them but max_flights times
// max_object_bytes (a terabyte as shipped): enough big downloads at once
// filled the disk under spool_dir. A write past the bound fails as one on
// a full disk does (fileError), and the download goes on as a relay to the
// readers it has (see download.relayInstead).
func TestSpoolFilesStayWithinTheirDiskBound(t *testing.T) {
	p := testSpools(t, 0) // no memory: every body goes to a file
	p.diskBudget = 256 << 10
	chunk := pattern(16 << 10)
	ctx := context.Background()
	refused := 0
	for range 3 {
		s := p.newSpool(64<<10, -1)
		defer s.release()
		for range 8 { // 128 KiB each
			err := s.write(ctx, chunk)
			if fe := (fileError{}); errors.As(err, &fe) {
				refused++
				break
			}
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	var onDisk int64
	ents, err := os.ReadDir(p.dir.path)
	if err != nil {
		t.Fatal(err)
	}
	for _, ent := range ents {
		if info, err := ent.Info(); err == nil && ent.Name() != "lock" {
			onDisk += info.Size()
		}
	}
	if onDisk > p.diskBudget || refused == 0 {
		t.Fatalf("spool files hold %d bytes for a bound of %d; %d writes refused", onDisk, p.diskBudget, refused)
	}
	if used := p.diskUsed.Load(); used != onDisk {
		t.Fatalf("accounted %d bytes, files hold %d", used, onDisk)
	}
}

// TestSpoolDiskBoundRelaysTheBody: a body bigger than spool_disk_bytes
// reaches its client whole, relayed and uncached, and leaves no file.
func TestSpoolDiskBoundRelaysTheBody(t *testing.T) {
	const size = 1 << 20
	body := pattern(size)
	f := newFixture(t, streamConfig(t, Config{MaxBodyBytes: 64 * bytesize.KiB, SpoolDiskBytes: 256 * bytesize.KiB}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(size))
		writeSlowly(w, body)
	}))
	for i := range 2 {
		if r := f.get("/big"); r.err != nil || r.xcache != CacheMiss || r.body != string(body) {
			t.Fatalf("request #%d: %s, %d of %d bytes, err %v; want the whole body, uncached", i, r.xcache, len(r.body), size, r.err)
		}
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.Stats().Spool.Active == 0 }, "every spool let go")
	if n, st := f.eng.spools.dir.files(), f.eng.Stats().Spool; n != 0 || st.DiskBytes != 0 || st.MaxDisk != 256<<10 {
		t.Fatalf("%d spool files left; stats %+v", n, st)
	}
}
