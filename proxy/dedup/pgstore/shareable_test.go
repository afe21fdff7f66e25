package pgstore

import (
	"crypto/rand"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestUnreadableValueNotShared: a response whose body compresses past 64
// to 1 fits max_value_bytes encoded, yet no instance could read it back
// (readers refuse a body over BodyLimit(max_value_bytes)). It is kept by
// its instance only: never stored for the fleet to reject, drop and fetch
// again on every request.
func TestUnreadableValueNotShared(t *testing.T) {
	body := strings.Repeat("0123456789abcdef", (6<<20)/16) // 6 MiB of text
	f := newFleet(t, 2, Config{MaxValueBytes: 64 * bytesize.KiB}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Cache-Control", "max-age=60")
		_, _ = io.WriteString(w, body)
	})
	a, b := f.insts[0], f.insts[1]
	url := f.origin.URL + "/compressible"
	if g := a.get(url); g.err != nil || g.status != 200 || len(g.body) != len(body) {
		t.Fatalf("a: %+v", g.err)
	}
	g := b.get(url)
	if g.err != nil || len(g.body) != len(body) {
		t.Fatalf("b: %v", g.err)
	}
	if a.be.Rejected() != 0 || b.be.Rejected() != 0 {
		t.Errorf("values rejected: a %d, b %d; want none stored that a reader refuses", a.be.Rejected(), b.be.Rejected())
	}
	if g := a.get(url); g.xcache != "HIT" {
		t.Errorf("a's own copy: %s, want a HIT", g.xcache)
	}
}

// TestBigValueWaiterGetsTheResponse: a response that fits
// max_body_bytes but not max_value_bytes, fetched while another instance
// waits on the flight (no peer listeners): the waiter's client must get
// the response (its own fetch, as with a TooLarge outcome), not an error.
func TestBigValueWaiterGetsTheResponse(t *testing.T) {
	body := make([]byte, 256<<10)
	rand.Read(body)
	release := make(chan struct{})
	var n atomic.Int64
	f := newFleet(t, 2, Config{MaxValueBytes: 64 * bytesize.KiB}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 1 {
			<-release
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Cache-Control", "max-age=60")
		_, _ = w.Write(body)
	})
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	a, b := f.insts[0], f.insts[1]
	url := f.origin.URL + "/big-value"
	ga := make(chan got, 1)
	go func() { ga <- a.get(url) }()
	waitFor(t, "a leading", func() bool { return n.Load() == 1 })
	gb := make(chan got, 1)
	go func() { gb <- b.get(url) }()
	waitFor(t, "b waiting on a's flight", func() bool { return f.everyoneWaiting(2) })
	close(release)
	if g := <-ga; g.err != nil || g.body != string(body) {
		t.Fatalf("leader: %v", g.err)
	}
	if g := <-gb; g.err != nil || g.body != string(body) {
		t.Fatalf("waiter on the other instance: status %d, x-cache %s, %d bytes, err %v; want the response", g.status, g.xcache, len(g.body), g.err)
	}
}
