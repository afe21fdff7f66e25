package pgstore

import (
	"context"
	"crypto/rand"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestInvalidationReachesEveryDiskTier: a body too big for Redis is cached
// in the disk tier of the instance that fetched it, which only that
// process holds. An invalidation made on another instance, by URL or by
// key, must reach it there too: before, the other instance's disk tier
// kept serving the old body as a HIT for its whole TTL.
func TestInvalidationReachesEveryDiskTier(t *testing.T) {
	body := make([]byte, 256<<10)
	rand.Read(body)
	f := newFleet(t, 2, Config{MaxValueBytes: 64 << 10}, dedup.Config{MaxBodyBytes: 64 << 10, Disk: dedup.DiskConfig{Dir: t.TempDir(), MaxBytes: 64 << 20}},
		func(w http.ResponseWriter, r *http.Request) { w.Write(body) })
	a, b := f.insts[0], f.insts[1]
	for _, by := range []string{"url", "key"} {
		t.Run(by, func(t *testing.T) {
			url := f.origin.URL + "/big-" + by
			onDisk := a.engine.Stats().Disk.Entries
			first := a.get(url)
			if first.err != nil || first.xcache != dedup.CacheMiss || first.body != string(body) {
				t.Fatalf("first request: %s %v, %d bytes", first.xcache, first.err, len(first.body))
			}
			// The download goes to the disk tier once its client has it.
			testkit.Eventually(t, testkit.Patience, func() bool { return a.engine.Stats().Disk.Entries == onDisk+1 }, "the body to reach the disk tier")
			if g := a.get(url); g.xcache != dedup.CacheHit {
				t.Fatalf("second request on the same instance: %s %v, want a HIT from its disk tier", g.xcache, g.err)
			}
			hits := f.hits.Load()
			var err error
			if by == "url" {
				_, err = b.engine.InvalidateURL(context.Background(), url)
			} else {
				err = b.engine.InvalidateKey(context.Background(), first.key)
			}
			if err != nil {
				t.Fatal(err)
			}
			// The event reaches the other instance in its own time: until
			// it does, a HIT is still right. Well within the entry's TTL
			// (newFleet's minute), whose end would let it go anyway.
			var last got
			if !testkit.Poll(15*time.Second, func() bool {
				last = a.get(url)
				return last.xcache != dedup.CacheHit
			}) {
				t.Fatalf("the instance that fetched it still answers %s from its disk tier after the invalidation on another instance", last.xcache)
			}
			if last.xcache != dedup.CacheMiss || last.body != string(body) || f.hits.Load() != hits+1 {
				t.Fatalf("after the invalidation: %s %v, origin fetched %d times more, want one MISS", last.xcache, last.err, f.hits.Load()-hits)
			}
		})
	}
}

// TestInvalidationDuringAFleetFlight: a flight still downloading when
// another instance invalidates its URL does not store what it fetched in
// the fleet's store (it was asked of the origin before the invalidation).
// Before, it did, and every instance answered the invalidated response as
// a HIT for its TTL.
func TestInvalidationDuringAFleetFlight(t *testing.T) {
	arrived, release := make(chan struct{}), make(chan struct{})
	var calls atomic.Int64
	f := newFleet(t, 2, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
		body := []byte("the page as it was")
		if calls.Add(1) > 1 {
			body = []byte("the page as it is")
		}
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		if calls.Load() > 1 {
			w.Write(body)
			return
		}
		w.Write(body[:4])
		w.(http.Flusher).Flush()
		close(arrived)
		<-release
		w.Write(body[4:])
	})
	a, b := f.insts[0], f.insts[1]
	heard := make(chan struct{}, 1)
	stop := a.store.OnInvalidated(func(dedup.Invalidation) {
		select {
		case heard <- struct{}{}:
		default:
		}
	})
	defer stop()
	url := f.origin.URL + "/page"
	first := make(chan got, 1)
	go func() { first <- a.get(url) }()
	<-arrived
	if _, err := b.engine.InvalidateURL(context.Background(), url); err != nil {
		t.Fatal(err)
	}
	<-heard // the leader's instance knows before its flight ends
	close(release)
	if g := <-first; g.xcache != dedup.CacheMiss || g.body != "the page as it was" {
		t.Fatalf("the flight's own client: %s %q %v", g.xcache, g.body, g.err)
	}
	if g := b.get(url); g.xcache != dedup.CacheMiss || g.body != "the page as it is" {
		t.Fatalf("after the invalidation, on the other instance: %s %q, want a MISS with the new page", g.xcache, g.body)
	}
}
