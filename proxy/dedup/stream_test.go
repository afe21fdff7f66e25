package dedup

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// streamConfig puts the spool and the disk tier in the test's own
// directories (so the test can look at them), with a minute of TTL.
func streamConfig(t testing.TB, c Config) Config {
	t.Helper()
	if c.SpoolDir == "" {
		c.SpoolDir = t.TempDir()
	}
	if c.Disk.Dir == "" {
		c.Disk.Dir = t.TempDir()
	}
	if c.Disk.MaxBytes == 0 {
		c.Disk.MaxBytes = 256 * bytesize.MiB
	}
	if c.TTL == 0 {
		c.TTL = time.Minute
	}
	return c
}

// pattern is n bytes that differ everywhere (a linear congruential
// sequence): a body delivered out of order or with a hole does not compare
// equal by accident.
func pattern(n int) []byte {
	b := make([]byte, n)
	x := uint32(2463534242)
	for i := range b {
		x = x*1664525 + 1013904223
		b[i] = byte(x >> 24)
	}
	return b
}

// writeSlowly writes body in 64 KiB pieces, flushing each.
func writeSlowly(w http.ResponseWriter, body []byte) error {
	rc := http.NewResponseController(w)
	for len(body) > 0 {
		n := min(len(body), 64<<10)
		if _, err := w.Write(body[:n]); err != nil {
			return err
		}
		rc.Flush()
		body = body[n:]
	}
	return nil
}

// files lists the regular files under dir (lock files aside) and their
// total size.
func files(t *testing.T, dir string) (n int, size int64) {
	t.Helper()
	filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() == "lock" {
			return nil
		}
		if info, err := d.Info(); err == nil {
			n++
			size += info.Size()
		}
		return nil
	})
	return n, size
}

// entries counts what dir holds, directories included.
func entries(t *testing.T, dir string) int {
	t.Helper()
	n := -1 // dir itself
	filepath.WalkDir(dir, func(string, fs.DirEntry, error) error { n++; return nil })
	return n
}

// peakHeap runs f and returns how far the heap in use grew above where it
// started while f ran (sampled every few milliseconds).
func peakHeap(f func()) int64 {
	runtime.GC()
	var base runtime.MemStats
	runtime.ReadMemStats(&base)
	var peak atomic.Uint64
	stop, sampled := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(sampled)
		var m runtime.MemStats
		for {
			runtime.ReadMemStats(&m)
			if m.HeapInuse > peak.Load() {
				peak.Store(m.HeapInuse)
			}
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	}()
	f()
	close(stop)
	<-sampled
	return int64(peak.Load()) - int64(base.HeapInuse)
}

// interest counts the requests on the flight for key (0: none runs).
func (f *fixture) interest(key string) int {
	fs := &f.eng.flights
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if fl := fs.m[key]; fl != nil {
		return fl.interest
	}
	return 0
}

// open sends a GET through the engine and returns the response with its
// body unread.
func (f *fixture) open(ctx context.Context, path string, kv ...string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, f.origin.URL+path, nil)
	if err != nil {
		f.t.Fatal(err)
	}
	for i := 0; i+1 < len(kv); i += 2 {
		req.Header.Add(kv[i], kv[i+1])
	}
	return f.eng.RoundTrip(req)
}

// TestFortyReadersOneDownload: 40 clients ask at once for one 24 MB body.
// One origin download; 40 complete bodies, byte for byte; the heap does
// not hold the body once per client (nor once: it spools to a file); the
// next request is a HIT from the disk tier.
func TestFortyReadersOneDownload(t *testing.T) {
	const n, size = 40, 24_000_000
	body := pattern(size)
	want := sha256.Sum256(body)
	var f *fixture
	f = newFixture(t, streamConfig(t, Config{}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Everyone is on the flight before the first byte.
		if !testkit.Wait(t, testkit.Patience, func() bool { return f.eng.Stats().Waiters == n }, "%d waiters", n) {
			return
		}
		w.Header().Set("Content-Length", strconv.Itoa(size))
		writeSlowly(w, body)
	}))
	type got struct {
		xcache string
		sum    [32]byte
		n      int64
		err    error
	}
	res := make(chan got, n)
	growth := peakHeap(func() {
		var wg sync.WaitGroup
		for range n {
			wg.Go(func() {
				resp, err := f.open(context.Background(), "/big.bin")
				if err != nil {
					res <- got{err: err}
					return
				}
				defer resp.Body.Close()
				h := sha256.New()
				k, err := io.Copy(h, resp.Body)
				var g got
				g.xcache, g.n, g.err = resp.Header.Get(HeaderCache), k, err
				copy(g.sum[:], h.Sum(nil))
				res <- g
			})
		}
		wg.Wait()
	})
	counts := map[string]int{}
	for range n {
		g := <-res
		if g.err != nil || g.n != size || g.sum != want {
			t.Fatalf("a client got %d bytes (err %v), equal: %v", g.n, g.err, g.sum == want)
		}
		counts[g.xcache]++
	}
	if counts[CacheMiss] != 1 || counts[CacheCoalesced] != n-1 {
		t.Errorf("X-Cache counts %v, want 1 MISS and %d COALESCED", counts, n-1)
	}
	if hits := f.up.n.Load(); hits != 1 {
		t.Fatalf("origin downloads = %d, want 1", hits)
	}
	t.Logf("heap in use grew by at most %.1f MiB while 40 clients read 24 MB each", float64(growth)/(1<<20))
	if growth > 48<<20 {
		t.Errorf("heap grew by %d MiB: bodies were buffered", growth>>20)
	}
	r := f.get("/big.bin")
	if r.xcache != CacheHit || sha256.Sum256([]byte(r.body)) != want || r.header.Get("Age") == "" {
		t.Fatalf("after: X-Cache %s, %d bytes", r.xcache, len(r.body))
	}
	if st := f.eng.Stats(); st.Disk == nil || st.Disk.Entries != 1 || st.Store.Entries != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// TestFirstBytesBeforeTheOriginFinishes: the origin sends 64 KiB and then
// holds the rest until the test says so. Every client, the leader and
// those that join mid-download alike, gets its first bytes before that.
func TestFirstBytesBeforeTheOriginFinishes(t *testing.T) {
	const n = 10
	body := pattern(1 << 20)
	release := make(chan struct{})
	f := newFixture(t, streamConfig(t, Config{}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		writeSlowly(w, body[:64<<10])
		<-release
		writeSlowly(w, body[64<<10:])
	}))
	first := make(chan error, n)
	done := make(chan error, n)
	client := func() {
		resp, err := f.open(context.Background(), "/page")
		if err != nil {
			first <- err
			return
		}
		defer resp.Body.Close()
		head := make([]byte, 4096)
		if _, err := io.ReadFull(resp.Body, head); err != nil || !bytes.Equal(head, body[:4096]) {
			first <- fmt.Errorf("first bytes: %v", err)
			return
		}
		first <- nil
		rest, err := io.ReadAll(resp.Body)
		if err == nil && !bytes.Equal(append(head, rest...), body) {
			err = errors.New("body differs")
		}
		done <- err
	}
	go client() // the leader
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for range n - 1 {
		go client() // they join the flight in the middle of its download
	}
	for range n - 1 {
		select {
		case err := <-first:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(time.Minute):
			t.Fatal("a client got no byte while the origin held the rest of the body")
		}
	}
	close(release)
	for range n {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	if hits := f.up.n.Load(); hits != 1 {
		t.Fatalf("origin downloads = %d", hits)
	}
}

// TestSlowReaderHoldsBackNobody: one client reads at 100 KB/s, another as
// fast as it can. The fast one and the download itself finish while the
// slow one has read less than a tenth; the slow one then gets the whole
// body too.
func TestSlowReaderHoldsBackNobody(t *testing.T) {
	const size = 24_000_000
	body := pattern(size)
	originDone := make(chan struct{})
	var f *fixture
	f = newFixture(t, streamConfig(t, Config{}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer close(originDone)
		if !testkit.Wait(t, testkit.Patience, func() bool { return f.eng.Stats().Waiters == 2 }, "two waiters") {
			return
		}
		w.Header().Set("Content-Length", strconv.Itoa(size))
		writeSlowly(w, body)
	}))
	var slowRead atomic.Int64
	hurry := make(chan struct{})
	slowDone := make(chan error, 1)
	go func() {
		resp, err := f.open(context.Background(), "/video")
		if err != nil {
			slowDone <- err
			return
		}
		defer resp.Body.Close()
		var got bytes.Buffer
		buf := make([]byte, 10_000)
		tick := time.NewTicker(100 * time.Millisecond) // 10 KB a tick: 100 KB/s
		defer tick.Stop()
	slow:
		for {
			k, err := io.ReadFull(resp.Body, buf)
			got.Write(buf[:k])
			slowRead.Add(int64(k))
			if err != nil {
				slowDone <- err
				return
			}
			select {
			case <-tick.C:
			case <-hurry:
				break slow
			}
		}
		_, err = io.Copy(&got, resp.Body)
		if err == nil && !bytes.Equal(got.Bytes(), body) {
			err = errors.New("slow reader's body differs")
		}
		slowDone <- err
	}()
	fast := f.get("/video")
	if fast.err != nil || fast.body != string(body) {
		t.Fatalf("fast reader: %d bytes, %v", len(fast.body), fast.err)
	}
	<-originDone
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.flights.running() == 0 }, "the download to end") // the download is over
	if got := slowRead.Load(); got >= size/10 {
		t.Fatalf("the slow reader read %d of %d bytes before the others finished: it held them back", got, size)
	} else {
		t.Logf("fast reader and download done while the slow one had read %d bytes (%.1f%%)", got, float64(got)*100/size)
	}
	close(hurry)
	if err := <-slowDone; err != nil {
		t.Fatal(err)
	}
	if hits := f.up.n.Load(); hits != 1 {
		t.Fatalf("origin downloads = %d", hits)
	}
}

// TestMidBodyFailureFailsEveryReader: an origin that fails in the middle
// of the body (an HTTP/1.1 connection cut before its Content-Length, a
// chunked body without its last chunk, an HTTP/2 RST_STREAM) fails it for
// every reader, and nothing is cached.
func TestMidBodyFailureFailsEveryReader(t *testing.T) {
	for _, tc := range []struct {
		name          string
		h2, chunked   bool
		maxBody       bytesize.Size
		wantSpoolFile bool
	}{
		{name: "h1 content-length", maxBody: 64 * bytesize.KiB, wantSpoolFile: true},
		{name: "h1 chunked", chunked: true},
		{name: "h2 rst_stream", h2: true},
		{name: "h2 rst_stream chunked", h2: true, chunked: true, maxBody: 64 * bytesize.KiB},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const n = 5
			body := pattern(1 << 20)
			var calls atomic.Int64
			cut := make(chan struct{})
			var f *fixture
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if !tc.chunked {
					w.Header().Set("Content-Length", strconv.Itoa(len(body)))
				}
				if calls.Add(1) > 1 {
					w.Write(body)
					return
				}
				if !testkit.Wait(t, testkit.Patience, func() bool { return f.eng.Stats().Waiters == n }, "%d waiters", n) {
					return
				}
				writeSlowly(w, body[:len(body)/2])
				<-cut
				// net/http cuts the connection (HTTP/1.1) or resets the
				// stream (HTTP/2).
				panic(http.ErrAbortHandler)
			})
			origin := httptest.NewUnstartedServer(h)
			origin.Config.ErrorLog = nil
			origin.EnableHTTP2 = tc.h2
			var tr *http.Transport
			if tc.h2 {
				origin.StartTLS()
				tr = origin.Client().Transport.(*http.Transport).Clone()
			} else {
				origin.Start()
				tr = &http.Transport{}
			}
			t.Cleanup(origin.Close)
			tr.DisableCompression = true
			f = newFixtureOn(t, streamConfig(t, Config{MaxBodyBytes: tc.maxBody}), origin, tr)

			errs := make(chan error, n)
			started := make(chan struct{}, n)
			for range n {
				go func() {
					resp, err := f.open(context.Background(), "/cut")
					if err != nil {
						started <- struct{}{}
						errs <- err
						return
					}
					defer resp.Body.Close()
					head := make([]byte, 1024)
					_, err = io.ReadFull(resp.Body, head)
					started <- struct{}{}
					if err != nil {
						errs <- err
						return
					}
					rest, err := io.ReadAll(resp.Body)
					if err == nil {
						err = fmt.Errorf("read %d bytes and a clean end", len(head)+len(rest))
					} else {
						err = nil
					}
					errs <- err
				}()
			}
			for range n {
				<-started
			}
			if tc.wantSpoolFile {
				if st := f.eng.Stats(); st.Spool.Files != 1 {
					t.Errorf("spool %+v, want the body in a file", st.Spool)
				}
			}
			close(cut)
			for range n {
				if err := <-errs; err != nil {
					t.Fatalf("a reader: %v", err)
				}
			}
			testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.Stats().Spool.Active == 0 }, "the spools to go")
			if st := f.eng.Stats(); st.Store.Entries != 0 || st.Disk.Entries != 0 {
				t.Fatalf("a cut body was cached: %+v", st)
			}
			if k, _ := files(t, f.eng.cfg.SpoolDir); k != 0 {
				t.Fatalf("%d spool files left", k)
			}
			if r := f.get("/cut"); r.xcache != CacheMiss || r.body != string(body) {
				t.Fatalf("next request: %s, %d bytes", r.xcache, len(r.body))
			}
		})
	}
}

// TestRangeFromObject: Range requests are answered from a whole object,
// in flight (before its bytes have all come) or cached, with 206 and the
// right Content-Range; the origin is asked once.
func TestRangeFromObject(t *testing.T) {
	const size = 1 << 20
	body := pattern(size)
	release := make(chan struct{})
	f := newFixture(t, streamConfig(t, Config{MaxBodyBytes: 64 * bytesize.KiB}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(size))
		w.Header().Set("ETag", `"v1"`)
		w.Header().Set("Accept-Ranges", "bytes")
		writeSlowly(w, body[:256<<10])
		<-release
		writeSlowly(w, body[256<<10:])
	}))
	leader, err := f.open(context.Background(), "/movie")
	if err != nil {
		t.Fatal(err)
	}
	defer leader.Body.Close()
	check := func(r result, status int, contentRange string, want []byte, xcache string) {
		t.Helper()
		if r.err != nil || r.status != status || r.header.Get("Content-Range") != contentRange || r.body != string(want) || r.xcache != xcache {
			t.Fatalf("got %d %q %s, %d bytes, err %v; want %d %q %s, %d bytes",
				r.status, r.header.Get("Content-Range"), r.xcache, len(r.body), r.err, status, contentRange, xcache, len(want))
		}
		if status == http.StatusPartialContent && r.header.Get("Content-Length") != strconv.Itoa(len(want)) {
			t.Fatalf("Content-Length %s for %d bytes", r.header.Get("Content-Length"), len(want))
		}
	}
	// In flight: the first bytes are there, so their range comes now.
	check(f.get("/movie", "Range", "bytes=100-1099"), 206, "bytes 100-1099/1048576", body[100:1100], CacheCoalesced)
	tail := make(chan result, 1)
	go func() { tail <- f.get("/movie", "Range", "bytes=-100") }()
	// On the flight (the leader and the tail) before the rest comes.
	testkit.Eventually(t, testkit.Patience, func() bool { return f.interest(leader.Header.Get(HeaderCacheKey)) == 2 }, "two requests on the flight")
	close(release)
	check(<-tail, 206, "bytes 1048476-1048575/1048576", body[size-100:], CacheCoalesced)
	if all, err := io.ReadAll(leader.Body); err != nil || !bytes.Equal(all, body) {
		t.Fatalf("leader: %d bytes, %v", len(all), err)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.flights.running() == 0 }, "the download to end")

	// Cached, on disk.
	check(f.get("/movie", "Range", "bytes=0-0"), 206, "bytes 0-0/1048576", body[:1], CacheHit)
	check(f.get("/movie", "Range", "bytes=1048000-"), 206, "bytes 1048000-1048575/1048576", body[1048000:], CacheHit)
	check(f.get("/movie", "Range", "bytes=1048000-99999999"), 206, "bytes 1048000-1048575/1048576", body[1048000:], CacheHit)
	check(f.get("/movie", "Range", "bytes=2000000-"), 416, "bytes */1048576", nil, CacheHit)
	check(f.get("/movie", "Range", "bytes=0-1,5-6"), 200, "", body, CacheHit) // several ranges: the whole
	check(f.get("/movie", "Range", "bytes=9-3"), 200, "", body, CacheHit)     // malformed: ignored
	check(f.get("/movie", "Range", "bytes=10-19", "If-Range", `"v1"`), 206, "bytes 10-19/1048576", body[10:20], CacheHit)
	check(f.get("/movie", "Range", "bytes=10-19", "If-Range", `"v0"`), 200, "", body, CacheHit)
	if r := f.get("/movie", "Range", "bytes=0-0"); r.header.Get("Age") == "" {
		t.Error("206 from the cache without Age")
	}
	if hits := f.up.n.Load(); hits != 1 {
		t.Fatalf("origin requests = %d, want 1", hits)
	}
}

// TestThousandObjectsLeaveNoFiles: 1,000 big objects whose clients hang up
// halfway. The spool directory ends empty, the disk tier stays within its
// bound, and Close leaves nothing behind.
func TestThousandObjectsLeaveNoFiles(t *testing.T) {
	const objects, size, workers = 1000, 48 << 10, 8
	const diskMax = 1 << 20
	body := pattern(size)
	cfg := streamConfig(t, Config{MaxBodyBytes: 16 * bytesize.KiB, Disk: DiskConfig{MaxBytes: diskMax}})
	f := newFixture(t, cfg, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/private") {
			// Not kept: its download stops with its last reader.
			w.Header().Set("Cache-Control", "no-store")
		}
		if r.URL.Query().Get("chunked") == "" {
			w.Header().Set("Content-Length", strconv.Itoa(size))
		}
		writeSlowly(w, body)
	}))
	next := make(chan int)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := range next {
				path := fmt.Sprintf("/obj/%d", i)
				if i%2 == 1 {
					path += "/private"
				}
				if i%3 == 0 {
					path += "?chunked=1"
				}
				resp, err := f.open(context.Background(), path)
				if err != nil {
					t.Error(err)
					return
				}
				half := make([]byte, size/2)
				if _, err := io.ReadFull(resp.Body, half); err != nil || !bytes.Equal(half, body[:size/2]) {
					t.Errorf("%s: %v", path, err)
				}
				resp.Body.Close()
			}
		})
	}
	for i := range objects {
		next <- i
	}
	close(next)
	wg.Wait()
	testkit.Eventually(t, testkit.Patience, func() bool {
		st := f.eng.Stats()
		return st.Spool.Active == 0 && st.Flights == 0
	}, "every flight and spool to end")
	if n, _ := files(t, cfg.SpoolDir); n != 0 {
		t.Fatalf("%d spool files left", n)
	}
	st := f.eng.Stats()
	n, bytesOnDisk := files(t, cfg.Disk.Dir)
	t.Logf("disk tier: %d files, %d bytes; %+v; spool %+v", n, bytesOnDisk, *st.Disk, st.Spool)
	if bytesOnDisk > diskMax || st.Disk.Bytes > diskMax || st.Disk.Entries == 0 || st.Disk.Evictions == 0 || n != st.Disk.Entries {
		t.Fatalf("disk tier out of bounds: %d files, %d bytes, %+v", n, bytesOnDisk, *st.Disk)
	}
	if st.Spool.MemoryBytes != 0 {
		t.Fatalf("spool memory still held: %+v", st.Spool)
	}
	f.eng.Close()
	if k := entries(t, cfg.SpoolDir) + entries(t, cfg.Disk.Dir); k != 0 {
		t.Fatalf("Close left %d files and directories", k)
	}
}

// TestStreamedBodyDecodedPerClient: a big body stored gzip goes as it is
// to a client that accepts gzip and decoded, as it streams, to one that
// does not; in flight and from the disk tier alike.
func TestStreamedBodyDecodedPerClient(t *testing.T) {
	plain := pattern(512 << 10) // incompressible: the gzip stays big
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(plain)
	zw.Close()
	var f *fixture
	f = newFixture(t, streamConfig(t, Config{MaxBodyBytes: 64 * bytesize.KiB}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !testkit.Wait(t, testkit.Patience, func() bool { return f.eng.Stats().Waiters == 2 }, "two waiters") {
			return
		}
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Set("Content-Length", strconv.Itoa(gz.Len()))
		w.Header().Set("ETag", `"z"`)
		writeSlowly(w, gz.Bytes())
	}))
	both := make(chan result, 2)
	go func() { both <- f.get("/z", "Accept-Encoding", "gzip") }()
	go func() { both <- f.get("/z") }()
	for _, when := range []string{"in flight", "cached"} {
		for range 2 {
			r := <-both
			if r.err != nil || r.status != 200 {
				t.Fatalf("%s: %+v", when, r.err)
			}
			if r.header.Get("Content-Encoding") == "gzip" {
				if r.body != gz.String() || r.header.Get("Content-Length") != strconv.Itoa(gz.Len()) {
					t.Fatalf("%s: the gzip bytes were altered", when)
				}
				continue
			}
			if r.body != string(plain) || r.header.Get("Content-Length") != "" || r.header.Get("ETag") != `W/"z"` {
				t.Fatalf("%s: decoded body: %d bytes, Content-Length %q, ETag %q", when, len(r.body), r.header.Get("Content-Length"), r.header.Get("ETag"))
			}
		}
		testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.flights.running() == 0 }, "the download to end")
		go func() { both <- f.get("/z", "Accept-Encoding", "gzip") }()
		go func() { both <- f.get("/z", "Accept-Encoding", "br") }()
	}
	if hits := f.up.n.Load(); hits != 1 {
		t.Fatalf("origin requests = %d, want 1", hits)
	}
}

// TestUnknownCodingFetchesForTheClient: a streamed body in a coding the
// engine cannot decode is fetched again for a client that does not
// accept it.
func TestUnknownCodingFetchesForTheClient(t *testing.T) {
	var f *fixture
	f = newFixture(t, streamConfig(t, Config{}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Accept-Encoding") == "" {
			io.WriteString(w, "plain")
			return
		}
		if !testkit.Wait(t, testkit.Patience, func() bool { return f.eng.Stats().Waiters == 2 }, "two waiters") {
			return
		}
		w.Header().Set("Content-Encoding", "compress")
		io.WriteString(w, "LZW bytes")
	}))
	both := make(chan result, 2)
	go func() { both <- f.get("/lzw", "Accept-Encoding", "compress") }()
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.Stats().Waiters == 1 }, "the leader") // it leads
	go func() { both <- f.get("/lzw") }()
	for range 2 {
		r := <-both
		want := "LZW bytes"
		if r.header.Get("Content-Encoding") == "" {
			want = "plain"
			if r.xcache != CacheBypass {
				t.Errorf("plain client: %s", r.xcache)
			}
		}
		if r.body != want {
			t.Errorf("got %q", r.body)
		}
	}
}

// TestLastReaderLeavingStopsWhatIsNotKept: a body that will not be cached
// stops downloading when its last reader hangs up; one that will be cached
// downloads to the end anyway (and is then a HIT).
func TestLastReaderLeavingStopsWhatIsNotKept(t *testing.T) {
	body := pattern(4 << 20)
	originGone := make(chan string, 2)
	f := newFixture(t, streamConfig(t, Config{}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/private" {
			w.Header().Set("Cache-Control", "private")
		}
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		writeSlowly(w, body[:64<<10])
		// The rest only once its clients hung up.
		<-r.Context().Done()
		originGone <- r.URL.Path
	}))
	for _, path := range []string{"/private", "/public"} {
		resp, err := f.open(context.Background(), path)
		if err != nil {
			t.Fatal(err)
		}
		io.ReadFull(resp.Body, make([]byte, 1000))
		resp.Body.Close()
	}
	select {
	case p := <-originGone:
		if p != "/private" {
			t.Fatalf("the download of %s was stopped", p)
		}
	case <-time.After(time.Minute):
		t.Fatal("the download nobody reads or keeps went on")
	}
	if f.eng.flights.running() != 1 {
		t.Fatalf("flights running = %d, want the public one", f.eng.flights.running())
	}
}

// TestStallTimeout: an origin that stops sending mid-body fails the body
// for its readers after stall_timeout, however long flight_timeout is.
func TestStallTimeout(t *testing.T) {
	f := newFixture(t, streamConfig(t, Config{StallTimeout: 200 * time.Millisecond, FlightTimeout: time.Hour}),
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", "100000")
			writeSlowly(w, make([]byte, 1000))
			<-r.Context().Done()
		}))
	r := f.get("/stall")
	var te interface{ Timeout() bool }
	if r.err == nil || !strings.Contains(r.err.Error(), "stall_timeout") || !asTimeout(r.err, &te) || len(r.body) != 1000 {
		t.Fatalf("got %d bytes, err %v", len(r.body), r.err)
	}
}

// TestCloseEndsDownloads: Close fails the bodies still downloading for
// their readers, waits for the flights, removes the spool files, and
// leaves no goroutine behind.
func TestCloseEndsDownloads(t *testing.T) {
	before := goleak.IgnoreCurrent()
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "10000000")
		writeSlowly(w, pattern(1<<20))
		<-r.Context().Done()
	}))
	defer origin.Close()
	cfg := streamConfig(t, Config{Enabled: true, MaxBodyBytes: 64 * bytesize.KiB})
	store := NewMemoryStore(1 << 20)
	defer store.Close()
	tr := &http.Transport{}
	eng, err := New(cfg, Options{Store: store, Next: tr, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest(http.MethodGet, origin.URL+"/long", nil)
	resp, err := eng.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := io.ReadFull(resp.Body, make([]byte, 1<<20)); err != nil {
		t.Fatal(err)
	}
	eng.Close()
	if _, err := io.ReadAll(resp.Body); err == nil || !errors.Is(err, errShuttingDown) {
		t.Fatalf("reader after Close: %v", err)
	}
	if k := entries(t, cfg.SpoolDir); k != 0 {
		t.Fatalf("Close left %d files and directories", k)
	}
	if _, err := eng.RoundTrip(req.Clone(context.Background())); err == nil {
		t.Fatal("a closed engine started a flight")
	}
	resp.Body.Close()
	origin.Close()
	tr.CloseIdleConnections()
	store.Close()
	if err := goleak.Find(before); err != nil {
		t.Fatal(err)
	}
}

// TestStaleRunDirsRemoved: a directory left by a process that died (its
// lock free) goes at the next start; a live one's stays.
func TestStaleRunDirsRemoved(t *testing.T) {
	parent := t.TempDir()
	live, err := openRunDir(parent)
	if err != nil {
		t.Fatal(err)
	}
	defer live.remove()
	dead, err := openRunDir(parent)
	if err != nil {
		t.Fatal(err)
	}
	dead.lock.Close() // the process died: its lock is free, its files stay
	old := time.Now().Add(-2 * staleAge)
	for _, d := range []*runDir{live, dead} {
		if err := chtimes(d.path, old); err != nil {
			t.Fatal(err)
		}
	}
	next, err := openRunDir(parent)
	if err != nil {
		t.Fatal(err)
	}
	defer next.remove()
	if dirExists(dead.path) {
		t.Error("the dead process's directory is still there")
	}
	if !dirExists(live.path) {
		t.Error("the live process's directory was removed")
	}
}

func chtimes(path string, t time.Time) error { return os.Chtimes(path, t, t) }

func dirExists(path string) bool {
	info, err := os.Stat(path)
	return err == nil && info.IsDir()
}

// limitedStore is a MemoryStore that, like Redis, cannot hold entries
// over a size.
type limitedStore struct {
	*MemoryStore
	max int64
}

func (s limitedStore) MaxEntryBytes() int64 { return s.max }

// TestStoreTooSmallKeepsTheBodyLocal: a body that fits in memory but not
// in the Store (over its MaxEntryBytes) is cached in the disk tier.
func TestStoreTooSmallKeepsTheBodyLocal(t *testing.T) {
	body := pattern(100 << 10)
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write(body) }))
	defer origin.Close()
	cfg := streamConfig(t, Config{Enabled: true})
	store := limitedStore{NewMemoryStore(64 << 20), 64 << 10}
	defer store.Close()
	up := &countingTransport{rt: &http.Transport{}}
	eng, err := New(cfg, Options{Store: store, Next: up, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	f := &fixture{t: t, eng: eng, up: up, origin: origin}
	if r := f.get("/mid"); r.xcache != CacheMiss || r.body != string(body) {
		t.Fatalf("first: %s", r.xcache)
	}
	if r := f.get("/mid"); r.xcache != CacheHit || r.body != string(body) {
		t.Fatalf("second: %s", r.xcache)
	}
	if st := eng.Stats(); st.Store.Entries != 0 || st.Disk.Entries != 1 || up.n.Load() != 1 {
		t.Fatalf("stats %+v, upstream %d", st, up.n.Load())
	}
}

// TestCachedBeforeTheLastByte: a client that knows the length is done at
// the last byte, without waiting for the end of the body; its next request
// must be a HIT, not a wait on the flight that is still storing the body.
func TestCachedBeforeTheLastByte(t *testing.T) {
	for _, size := range []int{10, 100 << 10, 3 << 20} { // memory store; memory store; disk tier
		body := pattern(size)
		f := newFixture(t, streamConfig(t, Config{MaxBodyBytes: bytesize.MiB}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", strconv.Itoa(size))
			writeSlowly(w, body)
		}))
		for i := range 20 {
			path := fmt.Sprintf("/exact/%d", i)
			resp, err := f.open(context.Background(), path)
			if err != nil {
				t.Fatal(err)
			}
			got := make([]byte, size)
			if _, err := io.ReadFull(resp.Body, got); err != nil || !bytes.Equal(got, body) {
				t.Fatalf("%d bytes: %v", size, err)
			}
			resp.Body.Close()
			if r := f.get(path); r.xcache != CacheHit || r.body != string(body) {
				t.Fatalf("%d bytes, #%d: next request %s", size, i, r.xcache)
			}
		}
	}
}

// TestSmallBodyReadWhole: a body declared at most smallBodyBytes is read
// whole before the flight answers. Every waiter gets it, and it is cached.
// One cut short (a connection closed, a stream reset) fails every waiter
// with the flight's error, which says so, before any header went out; it
// is not cached.
func TestSmallBodyReadWhole(t *testing.T) {
	const n = 5
	body := pattern(smallBodyBytes)
	for _, tc := range []struct {
		name    string
		h2      bool
		write   func(w http.ResponseWriter) // after the head
		wantErr string                      // "": the body arrives whole
	}{
		{name: "h1 whole", write: func(w http.ResponseWriter) { w.Write(body) }},
		{name: "h2 whole", h2: true, write: func(w http.ResponseWriter) { w.Write(body) }},
		{name: "h1 cut", wantErr: "unexpected EOF", write: func(w http.ResponseWriter) {
			w.Write(body[:1000])
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler)
		}},
		{name: "h2 reset", h2: true, wantErr: "INTERNAL_ERROR", write: func(w http.ResponseWriter) {
			w.Write(body[:1000])
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var f *fixture
			var calls atomic.Int64
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Length", strconv.Itoa(len(body)))
				if calls.Add(1) > 1 {
					w.Write(body)
					return
				}
				if !testkit.Wait(t, testkit.Patience, func() bool { return f.eng.Stats().Waiters == n }, "%d waiters", n) {
					return
				}
				tc.write(w)
			})
			origin := httptest.NewUnstartedServer(h)
			origin.Config.ErrorLog = log.New(io.Discard, "", 0)
			origin.EnableHTTP2 = tc.h2
			var tr *http.Transport
			if tc.h2 {
				origin.StartTLS()
				tr = origin.Client().Transport.(*http.Transport).Clone()
			} else {
				origin.Start()
				tr = &http.Transport{}
			}
			t.Cleanup(origin.Close)
			tr.DisableCompression = true
			f = newFixtureOn(t, Config{TTL: time.Minute}, origin, tr)

			results := make(chan result, n)
			for range n {
				go func() { results <- f.get("/small") }()
			}
			for range n {
				r := <-results
				if tc.wantErr == "" {
					if r.err != nil || r.body != string(body) {
						t.Fatalf("got %d bytes, %v", len(r.body), r.err)
					}
					continue
				}
				var e *Error
				if !errors.As(r.err, &e) || !strings.Contains(r.err.Error(), "read upstream body") || !strings.Contains(r.err.Error(), tc.wantErr) {
					t.Fatalf("got %d bytes (X-Cache %s), err %v; want a flight error with %q", len(r.body), r.xcache, r.err, tc.wantErr)
				}
			}
			if got := f.up.n.Load(); got != 1 {
				t.Fatalf("origin requests = %d, want 1 for %d clients", got, n)
			}
			again := f.get("/small")
			if tc.wantErr == "" && again.xcache != CacheHit {
				t.Fatalf("after a whole body: X-Cache %s, want HIT", again.xcache)
			}
			if tc.wantErr != "" && f.up.n.Load() != 2 {
				t.Fatal("a cut body was cached")
			}
		})
	}
}
