package dedup

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// totalInterest sums the interest of every flight in the registry.
func (f *fixture) totalInterest() int {
	fs := &f.eng.flights
	fs.mu.Lock()
	defer fs.mu.Unlock()
	n := 0
	for _, fl := range fs.m {
		n += fl.interest
	}
	return n
}

// TestUnkeepableBodyStopsWhenNobodyReads: a cacheable body becomes
// one nothing will keep while it downloads: one of unknown length outgrows
// memory with no disk tier, or outgrows disk.max_bytes; or one of declared
// length outlives its TTL (keep() then refuses it as expired). Its only
// client reads a little and hangs up. The download must stop ("stops when
// its last reader leaves a body nobody will keep"); it goes on to the end
// (up to max_object_bytes), for nobody, and is thrown away: obj.keep,
// decided once from the headers, is never revised.
func TestUnkeepableBodyStopsWhenNobodyReads(t *testing.T) {
	const rest = 48 << 20
	for _, tc := range []struct {
		name string
		disk bytesize.Size
		// ttl: a body of declared length that would fit the disk tier,
		// but whose download outlived its TTL before its client left:
		// keep() will not cache it ("expired already"), yet the flight
		// still counts it as kept.
		ttl time.Duration
	}{{"no disk tier", 0, 0}, {"past disk.max_bytes", 256 * bytesize.KiB, 0}, {"outlived its ttl", 256 * bytesize.MiB, time.Millisecond}} {
		t.Run(tc.name, func(t *testing.T) {
			clientGone := make(chan struct{})
			var sent atomic.Int64
			done := make(chan struct{})
			cfg := Config{MaxBodyBytes: 64 * bytesize.KiB, SpoolDir: t.TempDir(), TTL: time.Minute}
			if tc.ttl > 0 {
				cfg.TTL = tc.ttl
			}
			cfg.Disk.MaxBytes = tc.disk
			cfg.Disk.Dir = t.TempDir()
			chunk := pattern(64 << 10)
			f := newFixture(t, cfg, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				defer close(done)
				rc := http.NewResponseController(w)
				if tc.ttl > 0 {
					w.Header().Set("Content-Length", strconv.Itoa(8*len(chunk)+rest))
				}
				// No Content-Length: chunked. Past memory and the disk
				// tier before the client leaves.
				for range 8 {
					w.Write(chunk)
					rc.Flush()
				}
				<-clientGone
				for sent.Load() < rest {
					if _, err := w.Write(chunk); err != nil {
						return
					}
					if err := rc.Flush(); err != nil {
						return
					}
					sent.Add(int64(len(chunk)))
				}
			}))
			ctx, cancel := context.WithTimeout(context.Background(), testkit.Patience)
			defer cancel()
			resp, err := f.open(ctx, "/chunked")
			if err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(resp.Body, make([]byte, 8*len(chunk))); err != nil {
				t.Fatal(err)
			}
			if tc.ttl > 0 {
				// The TTL (from the headers) is over before the client leaves.
				expires := time.Now().Add(tc.ttl)
				testkit.Eventually(t, testkit.Patience, func() bool { return time.Now().After(expires) }, "the TTL to pass")
			}
			resp.Body.Close()
			close(clientGone)
			select {
			case <-done:
			case <-ctx.Done():
				t.Fatal("deadlock guard")
			}
			if sent.Load() >= rest {
				t.Fatalf("the origin sent all %d MiB after the only client hung up: the download of a body nothing can keep went on for nobody", rest>>20)
			}
		})
	}
}

// TestRangeOnAFlightWithAWholeEntry: a Range request joins a flight
// whose body the flight read whole (a body of at most 64 KiB; or, in a
// fleet, a whole entry another instance fetched). That entry holds every
// range, yet fromObject gives up on it ("not a body to cut") and the Range
// request goes upstream on its own.
func TestRangeOnAFlightWithAWholeEntry(t *testing.T) {
	const size = 10 << 10
	body := pattern(size)
	gate := testkit.NewGate(t)
	f := newFixture(t, streamConfig(t, Config{}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if rg := r.Header.Get("Range"); rg != "" {
			w.Header().Set("Content-Range", "bytes 100-199/"+strconv.Itoa(size))
			w.Header().Set("Content-Length", "100")
			w.WriteHeader(http.StatusPartialContent)
			w.Write(body[100:200])
			return
		}
		gate.Wait(r.Context())
		w.Header().Set("Content-Length", strconv.Itoa(size))
		w.Write(body)
	}))
	ctx, cancel := context.WithTimeout(context.Background(), testkit.Patience)
	defer cancel()
	leader := make(chan result, 1)
	go func() { leader <- f.do(ctx, http.MethodGet, "/page", nil, "") }()
	testkit.Eventually(t, testkit.Patience, func() bool { return f.totalInterest() == 1 }, "the leader on its flight")
	ranged := make(chan result, 1)
	go func() { ranged <- f.do(ctx, http.MethodGet, "/page", http.Header{"Range": {"bytes=100-199"}}, "") }()
	testkit.Eventually(t, testkit.Patience, func() bool { return f.totalInterest() == 2 }, "the Range request on the flight")
	gate.Open()
	if r := <-leader; r.err != nil || r.body != string(body) {
		t.Fatalf("leader: %d bytes, err %v", len(r.body), r.err)
	}
	r := <-ranged
	if r.err != nil || r.status != http.StatusPartialContent || !bytes.Equal([]byte(r.body), body[100:200]) {
		t.Fatalf("Range: status %d, %d bytes, err %v", r.status, len(r.body), r.err)
	}
	if n := f.up.n.Load(); n != 1 || r.xcache != CacheCoalesced {
		t.Fatalf("Range request answered %s with %d origin requests; want COALESCED from the flight's whole body and 1", r.xcache, n)
	}
}
