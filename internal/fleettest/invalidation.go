package fleettest

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

// InvalidationReachesEveryDiskTier: a body too big for the shared store is
// cached in the disk tier of the instance that fetched it, which only that
// process holds. An invalidation made on another instance, by URL or by
// key, reaches it there too: before, that disk tier kept serving the old
// body as a HIT for its whole TTL.
func InvalidationReachesEveryDiskTier(t *testing.T, newFleet Factory) {
	body := make([]byte, 256<<10)
	rand.Read(body)
	f := newFleet(t, Options{Instances: 2, Dedup: dedup.Config{TTL: time.Minute, MaxBodyBytes: 64 << 10,
		Disk: dedup.DiskConfig{Dir: t.TempDir(), MaxBytes: 64 << 20}}},
		func(w http.ResponseWriter, r *http.Request) { w.Write(body) })
	a, b := f.Insts[0], f.Insts[1]
	for _, by := range []string{"url", "key"} {
		t.Run(by, func(t *testing.T) {
			url := f.Origin.URL + "/big-" + by
			onDisk := a.Engine.Stats().Disk.Entries
			first := a.Get(url)
			if first.Err != nil || first.XCache != dedup.CacheMiss || first.Body != string(body) {
				t.Fatalf("first request: %s %v, %d bytes", first.XCache, first.Err, len(first.Body))
			}
			// The download goes to the disk tier once its client has it.
			testkit.Eventually(t, testkit.Patience, func() bool { return a.Engine.Stats().Disk.Entries == onDisk+1 }, "the body to reach the disk tier")
			if g := a.Get(url); g.XCache != dedup.CacheHit {
				t.Fatalf("second request on the same instance: %s %v, want a HIT from its disk tier", g.XCache, g.Err)
			}
			hits := f.Hits()
			var err error
			if by == "url" {
				_, err = b.Engine.InvalidateURL(context.Background(), url)
			} else {
				err = b.Engine.InvalidateKey(context.Background(), first.Key)
			}
			if err != nil {
				t.Fatal(err)
			}
			// The event reaches the other instance in its own time: until
			// it does, a HIT is still right. Well within the entry's TTL
			// (a minute), whose end would let it go anyway.
			var last Got
			if !testkit.Poll(15*time.Second, func() bool {
				last = a.Get(url)
				return last.XCache != dedup.CacheHit
			}) {
				t.Fatalf("the instance that fetched it still answers %s from its disk tier after the invalidation on another instance", last.XCache)
			}
			if last.XCache != dedup.CacheMiss || last.Body != string(body) || f.Hits() != hits+1 {
				t.Fatalf("after the invalidation: %s %v, origin fetched %d times more, want one MISS", last.XCache, last.Err, f.Hits()-hits)
			}
		})
	}
}

// InvalidationDuringAFleetFlight: a flight still downloading when another
// instance invalidates its URL does not store what it fetched in the
// fleet's store (it was asked of the origin before the invalidation).
// Before, it did, and every instance answered the invalidated response as
// a HIT for its TTL.
func InvalidationDuringAFleetFlight(t *testing.T, newFleet Factory) {
	arrived, release := make(chan struct{}), make(chan struct{})
	var calls atomic.Int64
	f := newFleet(t, Options{Instances: 2}, func(w http.ResponseWriter, r *http.Request) {
		body := []byte("the page as it was")
		n := calls.Add(1)
		if n > 1 {
			body = []byte("the page as it is")
		}
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		if n > 1 {
			w.Write(body)
			return
		}
		w.Write(body[:4])
		w.(http.Flusher).Flush()
		close(arrived)
		<-release
		w.Write(body[4:])
	})
	a, b := f.Insts[0], f.Insts[1]
	src, ok := a.Store.(dedup.InvalidationSource)
	if !ok {
		t.Fatalf("the store %T does not tell its engine of the fleet's invalidations (dedup.InvalidationSource)", a.Store)
	}
	heard := make(chan struct{}, 1)
	stop := src.OnInvalidated(func(dedup.Invalidation) {
		select {
		case heard <- struct{}{}:
		default:
		}
	})
	defer stop()
	url := f.Origin.URL + "/page"
	first := make(chan Got, 1)
	go func() { first <- a.Get(url) }()
	<-arrived
	if _, err := b.Engine.InvalidateURL(context.Background(), url); err != nil {
		t.Fatal(err)
	}
	<-heard // the leader's instance knows before its flight ends
	close(release)
	if g := <-first; g.XCache != dedup.CacheMiss || g.Body != "the page as it was" {
		t.Fatalf("the flight's own client: %s %q %v", g.XCache, g.Body, g.Err)
	}
	if g := b.Get(url); g.XCache != dedup.CacheMiss || g.Body != "the page as it is" {
		t.Fatalf("after the invalidation, on the other instance: %s %q, want a MISS with the new page", g.XCache, g.Body)
	}
}
