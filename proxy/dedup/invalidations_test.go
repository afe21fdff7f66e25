package dedup

import (
	"bytes"
	"context"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestInvalidationHooks: each registered hook hears every invalidation
// until its stop, and none after it (the engine closes its disk tier right
// after stopping its hook).
func TestInvalidationHooks(t *testing.T) {
	var h InvalidationHooks
	var a, b []Invalidation
	stopA := h.OnInvalidated(func(inv Invalidation) { a = append(a, inv) })
	stopB := h.OnInvalidated(func(inv Invalidation) { b = append(b, inv) })
	h.Invalidated(Invalidation{Key: "k1"})
	stopA()
	h.Invalidated(Invalidation{URLKey: "u1"})
	stopB()
	stopB() // twice is harmless
	h.Invalidated(Invalidation{Key: "k2"})
	if len(a) != 1 || a[0].Key != "k1" {
		t.Errorf("the first hook heard %v, want k1 alone", a)
	}
	if len(b) != 2 || b[0].Key != "k1" || b[1].URLKey != "u1" {
		t.Errorf("the second hook heard %v, want k1 then u1", b)
	}
}

// TestInvalidationDuringAFlight: a response whose headers arrived before
// an invalidation of its URL, and whose body after it, goes to the
// flight's client but is not cached: the invalidation says the origin's
// content until then is not to be served again. Before, the flight stored
// it once its body came, and the next request was a HIT on what had just
// been invalidated, in the memory store and in the disk tier alike.
func TestInvalidationDuringAFlight(t *testing.T) {
	for _, tc := range []struct {
		name string
		size int
		cfg  Config
	}{
		{"whole", 4 << 10, Config{TTL: time.Minute}},
		{"disk", 256 << 10, Config{TTL: time.Minute, MaxBodyBytes: 64 << 10,
			Disk: DiskConfig{Dir: t.TempDir(), MaxBytes: 64 << 20}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := bytes.Repeat([]byte("x"), tc.size)
			arrived, release := make(chan struct{}), make(chan struct{})
			var calls atomic.Int64
			f := newFixture(t, tc.cfg, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Length", strconv.Itoa(len(body)))
				if calls.Add(1) > 1 {
					w.Write(body)
					return
				}
				// The headers and half the body, then the invalidation.
				w.Write(body[:len(body)/2])
				w.(http.Flusher).Flush()
				close(arrived)
				<-release
				w.Write(body[len(body)/2:])
			}))
			first := make(chan result, 1)
			go func() { first <- f.get("/changed") }()
			<-arrived
			if _, err := f.eng.InvalidateURL(context.Background(), f.origin.URL+"/changed"); err != nil {
				t.Fatal(err)
			}
			close(release)
			if r := <-first; r.xcache != CacheMiss || len(r.body) != len(body) {
				t.Fatalf("the flight's own client: %s, %d bytes, want a MISS with all %d", r.xcache, len(r.body), len(body))
			}
			// The flight ends after its client has the body (a download
			// keeps it then).
			testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.Stats().Flights == 0 }, "the flight to end")
			if r := f.get("/changed"); r.xcache != CacheMiss || calls.Load() != 2 {
				t.Fatalf("after the invalidation: %s, origin asked %d times, want a MISS, the second", r.xcache, calls.Load())
			}
			if r := f.get("/changed"); r.xcache != CacheHit {
				t.Fatalf("the response fetched after the invalidation: %s, want it cached (HIT)", r.xcache)
			}
		})
	}
}

// TestInvalidationLog: what the log remembers and how it forgets.
func TestInvalidationLog(t *testing.T) {
	var l invalidationLog
	t0 := time.Now()
	if l.since("k", "u", t0.Add(-time.Hour)) {
		t.Fatal("an empty log reports an invalidation")
	}
	l.add(Invalidation{URLKey: "u1"}, t0)
	l.add(Invalidation{Key: "k1"}, t0.Add(time.Second))
	for _, c := range []struct {
		key, url string
		at       time.Time
		want     bool
	}{
		{"k0", "u1", t0.Add(-time.Second), true},      // fetched before its URL's invalidation
		{"k0", "u1", t0, true},                        // at the same instant
		{"k0", "u1", t0.Add(time.Millisecond), false}, // fetched after it
		{"k1", "u2", t0, true},
		{"k1", "u2", t0.Add(2 * time.Second), false},
		{"k2", "u2", t0.Add(-time.Minute), false}, // another URL
	} {
		if got := l.since(c.key, c.url, c.at); got != c.want {
			t.Errorf("since(%s, %s, t0%+v) = %v, want %v", c.key, c.url, c.at.Sub(t0), got, c.want)
		}
	}
	// Past its memory an invalidation is forgotten, conservatively:
	// anything fetched before it counts as invalidated.
	later := t0.Add(invalidationMemory + 2*time.Second)
	l.add(Invalidation{URLKey: "u3"}, later)
	if len(l.queue) != 1 || len(l.at) != 1 {
		t.Fatalf("kept %d records (%d ids) past their memory, want the newest alone", len(l.queue), len(l.at))
	}
	if !l.since("k2", "u2", t0) || l.since("k2", "u2", t0.Add(2*time.Second)) {
		t.Error("forgotten invalidations do not count for what was fetched before them alone")
	}
	// Bounded by count too.
	for i := range maxInvalidations + 10 {
		l.add(Invalidation{URLKey: "n" + strconv.Itoa(i)}, later)
	}
	if len(l.queue) > maxInvalidations || len(l.at) > maxInvalidations {
		t.Fatalf("%d records, %d ids: over the bound %d", len(l.queue), len(l.at), maxInvalidations)
	}
}
