package proxy_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// bigBody is n bytes that differ everywhere, so that a body delivered out
// of order or with a hole never compares equal.
func bigBody(n int) []byte {
	b := make([]byte, n)
	x := uint32(88172645)
	for i := range b {
		x = x*1664525 + 1013904223
		b[i] = byte(x >> 24)
	}
	return b
}

// flushIn writes b in 64 KiB pieces, flushing each.
func flushIn(w http.ResponseWriter, b []byte) error {
	rc := http.NewResponseController(w)
	for len(b) > 0 {
		n := min(len(b), 64<<10)
		if _, err := w.Write(b[:n]); err != nil {
			return err
		}
		rc.Flush()
		b = b[n:]
	}
	return nil
}

// streamDedup is dedup on, with the spool and the disk tier in the test's
// directories.
func streamDedup(t *testing.T, c dedup.Config) *dedup.Config {
	c.SpoolDir = t.TempDir()
	c.Disk = dedup.DiskConfig{Dir: t.TempDir(), MaxBytes: 256 * bytesize.MiB}
	return dedupOn(c)
}

// TestBigObjectFortyClients: 40 clients (half HTTP/1.1, half HTTP/2 inside
// the MITM) ask at once for one 24 MB file. The origin sends it once;
// every client gets all of it, byte for byte; the proxy's heap does not
// hold it per client.
func TestBigObjectFortyClients(t *testing.T) {
	const n, size = 40, 24_000_000
	body := bigBody(size)
	want := sha256.Sum256(body)
	var w *world
	var hits atomic.Int64
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		if !testkit.Wait(t, testkit.Patience, func() bool { return w.engine.Stats().Waiters == n }, "every client on the flight") {
			return
		}
		rw.Header().Set("Content-Length", strconv.Itoa(size))
		flushIn(rw, body)
	}), false)
	w = newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, dedup: streamDedup(t, dedup.Config{}), quiet: true})
	h1, h2 := w.client(false), w.client(true)
	type got struct {
		xcache, proto string
		sum           [32]byte
		n             int64
		err           error
	}
	res := make(chan got, n)
	growth, _ := heapGrowth(t, func() bool {
		var wg sync.WaitGroup
		for i := range n {
			c := h1
			if i%2 == 1 {
				c = h2
			}
			wg.Go(func() {
				resp, err := c.Get(origin.URL + "/file.iso")
				if err != nil {
					res <- got{err: err}
					return
				}
				defer resp.Body.Close()
				h := sha256.New()
				k, err := io.Copy(h, resp.Body)
				g := got{xcache: resp.Header.Get("X-Cache"), proto: resp.Proto, n: k, err: err}
				copy(g.sum[:], h.Sum(nil))
				res <- g
			})
		}
		wg.Wait()
		return true
	})
	counts := map[string]int{}
	for range n {
		g := <-res
		if g.err != nil || g.n != size || g.sum != want {
			t.Fatalf("a client got %d bytes (err %v), equal: %v", g.n, g.err, g.sum == want)
		}
		counts[g.xcache+" "+g.proto]++
	}
	if hits.Load() != 1 {
		t.Fatalf("origin downloads = %d, want 1", hits.Load())
	}
	t.Logf("X-Cache by protocol %v; heap in use grew by at most %.1f MiB", counts, float64(growth)/(1<<20))
	if counts["MISS HTTP/1.1"]+counts["MISS HTTP/2.0"] != 1 {
		t.Errorf("X-Cache counts %v, want one MISS", counts)
	}
	// 40 copies would be 960 MB; the spool keeps it in a file.
	if growth > 96<<20 {
		t.Errorf("heap grew by %d MiB: bodies were buffered", growth>>20)
	}
	resp, b := w.get(h2, origin.URL+"/file.iso")
	if resp.Header.Get("X-Cache") != "HIT" || sha256.Sum256([]byte(b)) != want {
		t.Fatalf("after: X-Cache %s, %d bytes", resp.Header.Get("X-Cache"), len(b))
	}
}

// TestFirstBytesThroughTheProxy: the origin sends its first kilobyte and
// holds the rest; every client, through the MITM over HTTP/1.1 and
// HTTP/2, gets that kilobyte before the test lets the origin go on (a
// proxy that only flushes full buffers would hold it).
func TestFirstBytesThroughTheProxy(t *testing.T) {
	const n = 6
	body := bigBody(4 << 20)
	var release *testkit.Gate
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		rw.Header().Set("Content-Length", strconv.Itoa(len(body)))
		flushIn(rw, body[:1000])
		if release.Wait(r.Context()) {
			flushIn(rw, body[1000:])
		}
	}), false)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, dedup: streamDedup(t, dedup.Config{})})
	release = testkit.NewGate(t)
	first := make(chan error, n)
	done := make(chan error, n)
	for i := range n {
		c := w.client(i%2 == 1)
		go func() {
			resp, err := c.Get(origin.URL + "/page")
			if err != nil {
				first <- err
				return
			}
			defer resp.Body.Close()
			head := make([]byte, 1000)
			if _, err := io.ReadFull(resp.Body, head); err != nil || !bytes.Equal(head, body[:1000]) {
				first <- fmt.Errorf("first bytes: %v", err)
				return
			}
			first <- nil
			rest, err := io.ReadAll(resp.Body)
			if err == nil && !bytes.Equal(append(head, rest...), body) {
				err = fmt.Errorf("body differs (%s)", resp.Proto)
			}
			done <- err
		}()
	}
	for range n {
		select {
		case err := <-first:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(time.Minute):
			t.Fatal("a client did not get the first kilobyte while the origin held the rest of the body")
		}
	}
	release.Open()
	for range n {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}

// TestMidBodyFailureThroughTheProxy: an origin that fails in the middle of
// a body is never a short 200 for the client. On the proxy port and inside
// a TLS tunnel, an HTTP/1.1 client sees its connection cut before the
// promised length or the last chunk, an HTTP/2 client an RST_STREAM; for
// bodies the flight spools and for those that stream past it (BYPASS).
func TestMidBodyFailureThroughTheProxy(t *testing.T) {
	body := bigBody(1 << 20)
	handler := func(chunked bool) http.Handler {
		return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
			if !chunked {
				rw.Header().Set("Content-Length", strconv.Itoa(len(body)))
			}
			flushIn(rw, body[:len(body)/2])
			// Cut: HTTP/1.1 closes the connection, HTTP/2 resets the stream.
			panic(http.ErrAbortHandler)
		})
	}
	for _, tc := range []struct {
		name      string
		tls       bool
		clientH2  bool
		originH1  bool
		chunked   bool
		maxObject bytesize.Size
		want      string // in the client's error
	}{
		{name: "proxy port, content-length", want: "unexpected EOF"},
		{name: "proxy port, chunked", chunked: true, want: "unexpected EOF"},
		{name: "proxy port, bypass", maxObject: 64 * bytesize.KiB, want: "unexpected EOF"},
		{name: "tunnel h1, content-length", tls: true, originH1: true, want: "unexpected EOF"},
		{name: "tunnel h1, chunked", tls: true, originH1: true, chunked: true, want: "unexpected EOF"},
		{name: "tunnel h1, bypass", tls: true, originH1: true, maxObject: 64 * bytesize.KiB, want: "unexpected EOF"},
		{name: "tunnel h2, origin rst_stream", tls: true, clientH2: true, want: "INTERNAL_ERROR"},
		{name: "tunnel h2, origin rst_stream, chunked", tls: true, clientH2: true, chunked: true, want: "INTERNAL_ERROR"},
		{name: "tunnel h2, h1 origin cut", tls: true, clientH2: true, originH1: true, chunked: true, want: "INTERNAL_ERROR"},
		{name: "tunnel h2, bypass", tls: true, clientH2: true, maxObject: 64 * bytesize.KiB, want: "INTERNAL_ERROR"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var origin *httptest.Server
			var cas []*x509.Certificate
			if tc.tls {
				origin = tlsOrigin(t, handler(tc.chunked), tc.originH1)
				cas = append(cas, origin.Certificate())
			} else {
				origin = plainOrigin(t, handler(tc.chunked))
			}
			cfg := dedup.Config{MaxObjectBytes: tc.maxObject}
			if tc.maxObject > 0 {
				cfg.MaxBodyBytes = 16 * bytesize.KiB
			}
			w := newWorld(t, worldOpts{originCAs: cas, dedup: streamDedup(t, cfg)})
			c := w.client(tc.clientH2)
			for range 2 { // the second would be a HIT if the cut body had been cached
				resp, err := c.Get(origin.URL + "/cut")
				if err != nil {
					// When the origin's reset overtakes the first body byte,
					// the proxy resets the stream before its headers went
					// out: the client learns of the cut one step earlier.
					if tc.clientH2 && strings.Contains(err.Error(), tc.want) {
						continue
					}
					t.Fatal(err)
				}
				if tc.clientH2 != (resp.ProtoMajor == 2) {
					t.Fatalf("client spoke %s", resp.Proto)
				}
				b, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("read %d of %d bytes (%s, X-Cache %s), err %v; want an error with %q",
						len(b), len(body), resp.Status, resp.Header.Get("X-Cache"), err, tc.want)
				}
				if xc := resp.Header.Get("X-Cache"); xc == "HIT" {
					t.Fatal("a cut body was cached")
				}
			}
		})
	}
}

// TestRangeThroughTheProxy: a Range request for a cached object is a 206
// from the cache, through the MITM; the origin is asked once.
func TestRangeThroughTheProxy(t *testing.T) {
	body := bigBody(2 << 20)
	var hits atomic.Int64
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		rw.Header().Set("Content-Length", strconv.Itoa(len(body)))
		flushIn(rw, body)
	}), false)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}, dedup: streamDedup(t, dedup.Config{})})
	c := w.client(true)
	if resp, b := w.get(c, origin.URL+"/v.mp4"); resp.Header.Get("X-Cache") != "MISS" || b != string(body) {
		t.Fatalf("first: %s, %d bytes", resp.Header.Get("X-Cache"), len(b))
	}
	req, _ := http.NewRequestWithContext(context.Background(), http.MethodGet, origin.URL+"/v.mp4", nil)
	req.Header.Set("Range", "bytes=1000000-1000999")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusPartialContent || resp.Header.Get("X-Cache") != "HIT" ||
		resp.Header.Get("Content-Range") != fmt.Sprintf("bytes 1000000-1000999/%d", len(body)) || !bytes.Equal(b, body[1000000:1001000]) {
		t.Fatalf("range: %s %s %q, %d bytes, %v", resp.Status, resp.Header.Get("X-Cache"), resp.Header.Get("Content-Range"), len(b), err)
	}
	if hits.Load() != 1 {
		t.Fatalf("origin requests = %d", hits.Load())
	}
}
