package dedup

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestFirstByteRangeOnChunkedBodyIsNotHeldForTheWholeDownload: a
// media player's Range: bytes=0- on a body without Content-Length starts
// the whole object's flight, and then waits for the body's length, i.e.
// for the whole download, before its first byte.
func TestFirstByteRangeOnChunkedBodyIsNotHeldForTheWholeDownload(t *testing.T) {
	const size = 256 << 10
	body := pattern(size)
	gate := testkit.NewGate(t)
	f := newFixture(t, streamConfig(t, Config{MaxBodyBytes: 16 * bytesize.KiB}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// No Content-Length: chunked.
		writeSlowly(w, body[:64<<10])
		gate.Wait(r.Context())
		writeSlowly(w, body[64<<10:])
	}))
	ctx, cancel := context.WithTimeout(context.Background(), testkit.Patience)
	defer cancel()
	type got struct {
		resp *http.Response
		err  error
	}
	out := make(chan got, 1)
	go func() {
		resp, err := f.open(ctx, "/video", "Range", "bytes=0-")
		out <- got{resp, err}
	}()
	var g got
	select {
	case g = <-out:
	case <-time.After(10 * time.Second):
		// The origin holds the rest until the gate opens: without an
		// answer by now, none comes before the whole download.
		gate.Open()
		g = <-out
		if g.resp != nil {
			g.resp.Body.Close()
		}
		t.Fatalf("bytes=0- on a chunked body: no response headers while the first 64 KiB were there; the client waits for the whole download")
	}
	if g.err != nil {
		t.Fatal(g.err)
	}
	defer g.resp.Body.Close()
	first := make([]byte, 64<<10)
	if _, err := io.ReadFull(g.resp.Body, first); err != nil || !bytes.Equal(first, body[:64<<10]) {
		t.Fatalf("first bytes: %v", err)
	}
	gate.Open()
	rest, err := io.ReadAll(g.resp.Body)
	if err != nil || !bytes.Equal(append(first, rest...), body) {
		t.Fatalf("whole body: %d bytes, err %v", len(first)+len(rest), err)
	}
}

// TestFirstByteRangeOnBigChunkedBodyDownloadsOnce: the same request
// for a chunked body bigger than max_object_bytes. The whole object's
// flight it started turns into a relay, the Range request (still waiting
// for a length) leaves it, which stops it, and goes upstream again with
// its Range: max_object_bytes downloaded for nothing, then the body again.
func TestFirstByteRangeOnBigChunkedBodyDownloadsOnce(t *testing.T) {
	const size = 512 << 10
	body := pattern(size)
	var sent atomic.Int64
	f := newFixture(t, streamConfig(t, Config{MaxBodyBytes: 16 * bytesize.KiB, MaxObjectBytes: 128 * bytesize.KiB}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		for off := 0; off < size; off += 16 << 10 {
			n, err := w.Write(body[off : off+16<<10])
			sent.Add(int64(n))
			if err != nil {
				return
			}
			rc.Flush()
		}
	}))
	ctx, cancel := context.WithTimeout(context.Background(), testkit.Patience)
	defer cancel()
	r := f.do(ctx, http.MethodGet, "/big", http.Header{"Range": {"bytes=0-"}}, "")
	if r.err != nil || r.body != string(body) {
		t.Fatalf("bytes=0-: %d bytes, err %v", len(r.body), r.err)
	}
	if n := f.up.n.Load(); n != 1 {
		t.Fatalf("one client's bytes=0- went upstream %d times (the origin sent %d bytes for a %d-byte body)", n, sent.Load(), size)
	}
}

// TestFleetRangeDownloadedOnce: two instances' clients ask for the
// same big range (a download manager's or a player's seek) of an object
// nobody holds. The range goes upstream with its own key, one fleet
// flight, and the leader instance streams its 206 to the fleet (the lease
// names its peer listener). The follower asks the peer, which answers the
// flight's response, the 206, and refuses it as "a part of the whole
// body": it downloads the range from the origin again.
func TestFleetRangeDownloadedOnce(t *testing.T) {
	const size = 1 << 20
	const from = 100
	body := pattern(size)
	release := make(chan struct{})
	var hits atomic.Int64
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := hits.Add(1)
		if r.Header.Get("Range") != "bytes="+strconv.Itoa(from)+"-" {
			t.Errorf("origin asked %q", r.Header.Get("Range"))
		}
		part := body[from:]
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Range", "bytes "+strconv.Itoa(from)+"-"+strconv.Itoa(size-1)+"/"+strconv.Itoa(size))
		w.Header().Set("Content-Length", strconv.Itoa(len(part)))
		w.WriteHeader(http.StatusPartialContent)
		if n > 1 {
			writeSlowly(w, part)
			return
		}
		writeSlowly(w, part[:128<<10])
		<-release
		writeSlowly(w, part[128<<10:])
	}))
	t.Cleanup(origin.Close)
	insts := peerFleet(t, 2, origin, Config{MaxBodyBytes: 256 * bytesize.KiB}, nil)
	t.Cleanup(func() { closeOnce(release) })
	a, b := insts[0], insts[1]
	open := func(in *peerInstance) (*http.Response, error) {
		req, err := http.NewRequest(http.MethodGet, origin.URL+"/big", nil)
		if err != nil {
			return nil, err
		}
		req.Header.Set("Range", "bytes="+strconv.Itoa(from)+"-")
		return in.eng.RoundTrip(req)
	}
	leader, err := open(a)
	if err != nil {
		t.Fatal(err)
	}
	defer leader.Body.Close()
	out := make(chan result, 1)
	go func() {
		resp, err := open(b)
		if err != nil {
			out <- result{err: err}
			return
		}
		defer resp.Body.Close()
		got, err := io.ReadAll(resp.Body)
		out <- result{status: resp.StatusCode, xcache: resp.Header.Get(HeaderCache), body: string(got), err: err}
	}()
	// The follower's request is on its own flight, reading the peer or
	// the origin, before the leader's origin goes on.
	key := leader.Header.Get(HeaderCacheKey)
	peerReading := func() bool {
		fs := &a.eng.flights
		fs.mu.Lock()
		defer fs.mu.Unlock()
		return fs.m[key] != nil && fs.m[key].interest == 2
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return hits.Load() == 2 || peerReading() }, "the follower reading the peer or the origin")
	closeOnce(release)
	if all, err := io.ReadAll(leader.Body); err != nil || !bytes.Equal(all, body[from:]) {
		t.Fatalf("leader: %d bytes, %v", len(all), err)
	}
	r := <-out
	if r.err != nil || r.status != http.StatusPartialContent || r.body != string(body[from:]) {
		t.Fatalf("follower: %d, %d bytes, %v", r.status, len(r.body), r.err)
	}
	if n := hits.Load(); n != 1 {
		t.Fatalf("origin sent the range %d times for the fleet (follower peer fetches %+v)", n, b.eng.Stats().PeerFetches)
	}
}

// TestFleetWaitersSurviveTheLeadersClientLeaving: a response not to
// cache (no-store), too big to read whole with its head, small enough to
// go to the other instances through the lease. The leader instance's
// only client reads a little and hangs up: the download is "kept by
// nobody, read by nobody", so it stops, and the lease ends with that
// failure. The other instance's client, which waited on the fleet's
// flight, gets a 502 for a response the origin was sending fine.
func TestFleetWaitersSurviveTheLeadersClientLeaving(t *testing.T) {
	const size = 512 << 10
	body := pattern(size)
	release := make(chan struct{})
	var hits atomic.Int64
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := hits.Add(1)
		w.Header().Set("Content-Length", strconv.Itoa(size))
		w.Header().Set("Cache-Control", "no-store")
		if n > 1 {
			writeSlowly(w, body)
			return
		}
		writeSlowly(w, body[:128<<10])
		<-release
		writeSlowly(w, body[128<<10:])
	}))
	t.Cleanup(origin.Close)
	insts := peerFleet(t, 2, origin, Config{MaxBodyBytes: 1 * bytesize.MiB}, nil)
	t.Cleanup(func() { closeOnce(release) })
	a, b := insts[0], insts[1]
	// Bodies up to 1 MiB go through the store (no peer streaming).
	for _, in := range insts {
		in.eng.fleet.(sfMember).f.above = 1 << 20
	}
	ctx, cancel := context.WithTimeout(context.Background(), testkit.Patience)
	defer cancel()
	leader, err := a.open(ctx, origin.URL+"/nostore")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(leader.Body, make([]byte, 64<<10)); err != nil {
		t.Fatal(err)
	}
	out := make(chan result, 1)
	go func() {
		resp, err := b.open(ctx, origin.URL+"/nostore")
		if err != nil {
			out <- result{err: err}
			return
		}
		defer resp.Body.Close()
		got, err := io.ReadAll(resp.Body)
		out <- result{status: resp.StatusCode, xcache: resp.Header.Get(HeaderCache), body: string(got), err: err}
	}()
	testkit.Eventually(t, testkit.Patience, func() bool { return b.eng.Stats().Waiters == 1 }, "the other instance's client waiting on the fleet's flight")
	// The leader's client hangs up.
	leader.Body.Close()
	closeOnce(release)
	r := <-out
	if r.err != nil || r.status != http.StatusOK || r.body != string(body) {
		t.Fatalf("the other instance's client: status %d, %d of %d bytes, err %v (origin hits %d)", r.status, len(r.body), size, r.err, hits.Load())
	}
}
