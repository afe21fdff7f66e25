package dedup

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

func testSpools(t *testing.T, budget int64) *spools {
	t.Helper()
	dir, err := openRunDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(dir.remove)
	return &spools{dir: dir, budget: budget, diskBudget: 1 << 30}
}

// TestSpoolSpillsWhenTheBudgetRunsOut: two spools share a 160 KiB budget;
// the one that cannot grow any more moves to a file, readers do not
// notice, and letting go returns the memory and removes the file.
func TestSpoolSpillsWhenTheBudgetRunsOut(t *testing.T) {
	p := testSpools(t, 160<<10)
	body := pattern(256 << 10)
	a, b := p.newSpool(1<<20, -1), p.newSpool(1<<20, -1)
	ra, _ := a.reader(context.Background(), 0, nil)
	ctx := context.Background()
	for off := 0; off < len(body); off += 16 << 10 {
		chunk := body[off : off+16<<10]
		if err := a.write(ctx, chunk); err != nil {
			t.Fatal(err)
		}
		if off < 32<<10 {
			if err := b.write(ctx, chunk); err != nil {
				t.Fatal(err)
			}
		}
	}
	a.finish(nil)
	b.finish(nil)
	if a.file == nil || b.file != nil {
		t.Fatalf("a in a file: %v, b in memory: %v", a.file != nil, b.file == nil)
	}
	if got, err := io.ReadAll(ra); err != nil || !bytes.Equal(got, body) {
		t.Fatalf("reader across the spill: %d bytes, %v", len(got), err)
	}
	if p.files.Load() != 1 || p.used.Load() > p.budget {
		t.Fatalf("files %d, memory %d of %d", p.files.Load(), p.used.Load(), p.budget)
	}
	name := a.file.Name()
	ra.Close()
	a.release()
	b.release()
	if _, err := os.Stat(name); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("spool file still there: %v", err)
	}
	if p.used.Load() != 0 || p.files.Load() != 0 || p.active.Load() != 0 {
		t.Fatalf("after release: used %d, files %d, active %d", p.used.Load(), p.files.Load(), p.active.Load())
	}
}

// TestSpoolReadersAtAnyOffset: a reader that opens late reads from byte
// 0, one that opens at an offset waits for it, and a failure reaches them
// after the bytes that came.
func TestSpoolReadersAtAnyOffset(t *testing.T) {
	p := testSpools(t, 1<<20)
	s := p.newSpool(1<<20, -1)
	ctx := context.Background()
	s.write(ctx, []byte("hello "))
	mid, _ := s.reader(ctx, 3, nil)
	late := make(chan []byte)
	go func() {
		r, _ := s.reader(ctx, 0, nil)
		b, _ := io.ReadAll(r)
		late <- b
	}()
	buf := make([]byte, 3)
	if _, err := io.ReadFull(mid, buf); err != nil || string(buf) != "lo " {
		t.Fatalf("mid reader: %q, %v", buf, err)
	}
	s.write(ctx, []byte("world"))
	boom := errors.New("origin went away")
	s.finish(boom)
	rest, err := io.ReadAll(mid)
	if string(rest) != "world" || !errors.Is(err, boom) {
		t.Fatalf("mid reader: %q, %v", rest, err)
	}
	if b := <-late; string(b) != "hello world" {
		t.Fatalf("late reader: %q", b)
	}
	// A reader whose client left gives up waiting.
	s2 := p.newSpool(1<<20, -1)
	cctx, cancel := context.WithCancel(ctx)
	r, _ := s2.reader(cctx, 0, nil)
	cancel()
	if _, err := r.Read(buf); !errors.Is(err, context.Canceled) {
		t.Fatalf("reader of a gone client: %v", err)
	}
}

// TestSpoolRelay: past max_object_bytes the spool passes each chunk on
// only once every reader has it, keeps one chunk, and still gives every
// reader the whole body.
func TestSpoolRelay(t *testing.T) {
	p := testSpools(t, 1<<20)
	s := p.newSpool(64<<10, -1)
	s.interest = func() int { return 2 }
	ctx := context.Background()
	body := pattern(1 << 20)
	s.write(ctx, body[:128<<10]) // spilled: over the 64 KiB memory bound
	s.startRelay()
	type got struct {
		b   []byte
		err error
	}
	out := make(chan got, 2)
	for _, pace := range []time.Duration{0, time.Millisecond} {
		r, err := s.reader(ctx, 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			var b bytes.Buffer
			buf := make([]byte, 8<<10)
			for {
				n, err := r.Read(buf)
				b.Write(buf[:n])
				if err == io.EOF {
					out <- got{b.Bytes(), nil}
					return
				}
				if err != nil {
					out <- got{nil, err}
					return
				}
				time.Sleep(pace)
			}
		}()
	}
	for off := 128 << 10; off < len(body); off += 32 << 10 {
		if err := s.write(ctx, body[off:off+32<<10]); err != nil {
			t.Fatal(err)
		}
		s.mu.Lock()
		kept := int64(len(s.mem))
		s.mu.Unlock()
		if kept > 32<<10 || s.file != nil {
			t.Fatalf("relay keeps %d bytes in memory, file %v", kept, s.file != nil)
		}
	}
	s.finish(nil)
	for range 2 {
		g := <-out
		if g.err != nil || !bytes.Equal(g.b, body) {
			t.Fatalf("relayed reader: %d bytes, %v", len(g.b), g.err)
		}
	}
	if _, err := s.reader(ctx, 0, nil); !errors.Is(err, errRelayed) {
		t.Fatalf("a late reader of a relayed body: %v", err)
	}
}

// TestDiskTierReplaceRemovesTheOldFile: a key stored again (a refetch
// after its TTL, a fleet copy given back) leaves one file on disk, not the
// old one too, which nothing would count against disk.max_bytes or remove
// before shutdown.
func TestDiskTierReplaceRemovesTheOldFile(t *testing.T) {
	dir, err := openRunDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	d := newDiskTier(dir, 1000)
	meta := &Entry{Status: 200, Header: http.Header{}, StoredAt: time.Now(), ExpiresAt: time.Now().Add(time.Hour)}
	for range 3 {
		if err := d.putBytes("a", meta, make([]byte, 100)); err != nil {
			t.Fatal(err)
		}
	}
	if st := d.stats(); st.Bytes != 100 || st.Entries != 1 || dir.files() != 1 {
		t.Fatalf("after storing one key three times: stats %+v, %d files", st, dir.files())
	}
}

// TestDiskTierEvictsLeastRecentlyUsed: the tier stays within its bytes,
// evicts the entry used least recently, expires, and forgets by URL.
func TestDiskTierEvictsLeastRecentlyUsed(t *testing.T) {
	dir, err := openRunDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	d := newDiskTier(dir, 300)
	src := func(n int) string {
		f, err := os.CreateTemp(t.TempDir(), "src")
		if err != nil {
			t.Fatal(err)
		}
		f.Write(make([]byte, n))
		f.Close()
		return f.Name()
	}
	meta := func(urlKey string, ttl time.Duration) *Entry {
		return &Entry{Status: 200, Header: http.Header{}, StoredAt: time.Now(), ExpiresAt: time.Now().Add(ttl), URLKey: urlKey}
	}
	for _, k := range []string{"a", "b", "c"} {
		if err := d.put(k, meta("u-"+k, time.Hour), src(100), 100); err != nil {
			t.Fatal(err)
		}
	}
	d.get("a") // b is now the least recently used
	if err := d.put("d", meta("u-a", time.Hour), src(100), 100); err != nil {
		t.Fatal(err)
	}
	if d.get("b") != nil || d.get("a") == nil || d.get("c") == nil || d.get("d") == nil {
		t.Fatal("wrong entry evicted")
	}
	if st := d.stats(); st.Bytes != 300 || st.Entries != 3 || st.Evictions != 1 || dir.files() != 3 {
		t.Fatalf("stats %+v, %d files", st, dir.files())
	}
	if err := d.put("big", meta("u", time.Hour), src(301), 301); !errors.Is(err, errTooBigForDisk) {
		t.Fatalf("a body over the bound: %v", err)
	}
	if n := d.deleteURL("u-a"); n != 2 || d.get("a") != nil || d.get("d") != nil {
		t.Fatalf("deleteURL removed %d", n)
	}
	d.put("e", meta("u", time.Nanosecond), src(10), 10)
	time.Sleep(time.Millisecond)
	if d.get("e") != nil {
		t.Fatal("expired entry served")
	}
	if dir.files() != 1 {
		t.Fatalf("%d files for one entry", dir.files())
	}
	d.close()
	if dirExists(dir.path) {
		t.Fatal("close left the directory")
	}
}

// TestSpilledSmallBodyIsKeptWhole: a body within max_body_bytes that went
// to a spool file because the spools' shared memory (spool_memory_bytes)
// ran out while it came is still cached whole in the Store, read back from
// its file. It used to count as too big: kept in the disk tier only when
// there is one (here there is none), and never handed to the fleet.
func TestSpilledSmallBodyIsKeptWhole(t *testing.T) {
	body := pattern(100 << 10)
	f := newFixture(t, Config{TTL: time.Minute, SpoolDir: t.TempDir(), SpoolMemoryBytes: 32 << 10},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", strconv.Itoa(len(body)))
			w.Write(body)
		}))
	if r := f.get("/page"); r.xcache != CacheMiss || r.body != string(body) {
		t.Fatalf("first: %s, %d bytes", r.xcache, len(r.body))
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.flights.running() == 0 }, "the flight to end")
	r := f.get("/page")
	if r.xcache != CacheHit || r.body != string(body) {
		t.Fatalf("second GET of a %d-byte body (max_body_bytes %s): X-Cache %s, %d bytes", len(body), f.eng.cfg.MaxBodyBytes, r.xcache, len(r.body))
	}
	if n := f.up.n.Load(); n != 1 {
		t.Errorf("upstream = %d, want 1", n)
	}
	if st := f.eng.Stats(); st.Disk != nil {
		t.Errorf("a disk tier in the test: %+v", st.Disk)
	}
}
