package dedup

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"sync"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestRangeFromFirstByteFetchesTheWholeObject: a media player's first
// request (Range: bytes=0-) starts the whole object's download instead of
// a ranged one. A plain GET, and the player's later seeks, arriving while
// it runs or after it, are answered from it: the origin sends the object
// once and never sees a Range.
func TestRangeFromFirstByteFetchesTheWholeObject(t *testing.T) {
	const size = 1 << 20
	body := pattern(size)
	gate := testkit.NewGate(t)
	var mu sync.Mutex
	var ranges []string
	f := newFixture(t, streamConfig(t, Config{MaxBodyBytes: 64 * bytesize.KiB}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		ranges = append(ranges, r.Header.Get("Range"))
		mu.Unlock()
		w.Header().Set("Content-Length", strconv.Itoa(size))
		w.Header().Set("Accept-Ranges", "bytes")
		writeSlowly(w, body[:128<<10])
		gate.Wait(r.Context())
		writeSlowly(w, body[128<<10:])
	}))
	player, err := f.open(context.Background(), "/video", "Range", "bytes=0-")
	if err != nil {
		t.Fatal(err)
	}
	defer player.Body.Close()
	if player.StatusCode != http.StatusPartialContent || player.Header.Get("Content-Range") != "bytes 0-1048575/1048576" ||
		player.Header.Get(HeaderCache) != CacheMiss || player.ContentLength != size {
		t.Fatalf("bytes=0-: %d %q %s, length %d", player.StatusCode, player.Header.Get("Content-Range"), player.Header.Get(HeaderCache), player.ContentLength)
	}
	// While it downloads: a plain GET, a seek, and a second player.
	plain := make(chan result, 1)
	go func() { plain <- f.get("/video") }()
	seek := f.get("/video", "Range", "bytes=1000-1999")
	if seek.status != http.StatusPartialContent || seek.body != string(body[1000:2000]) || seek.xcache != CacheCoalesced {
		t.Fatalf("seek in flight: %d %s, %d bytes", seek.status, seek.xcache, len(seek.body))
	}
	second := make(chan result, 1)
	go func() { second <- f.get("/video", "Range", "bytes=0-") }()
	key := player.Header.Get(HeaderCacheKey)
	testkit.Eventually(t, testkit.Patience, func() bool { return f.interest(key) == 3 }, "the plain GET and the second player on the flight")
	gate.Open()
	all, err := io.ReadAll(player.Body)
	if err != nil || string(all) != string(body) {
		t.Fatalf("player: %d bytes, %v", len(all), err)
	}
	if r := <-plain; r.status != http.StatusOK || r.body != string(body) || r.xcache != CacheCoalesced {
		t.Fatalf("plain GET: %d %s, %d bytes, %v", r.status, r.xcache, len(r.body), r.err)
	}
	if r := <-second; r.status != http.StatusPartialContent || r.body != string(body) || r.header.Get("Content-Range") != "bytes 0-1048575/1048576" {
		t.Fatalf("second player: %d %q, %d bytes, %v", r.status, r.header.Get("Content-Range"), len(r.body), r.err)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.flights.running() == 0 }, "the download to end")
	// Cached now: another player's first request and a seek are hits.
	if r := f.get("/video", "Range", "bytes=0-"); r.status != http.StatusPartialContent || r.body != string(body) || r.xcache != CacheHit {
		t.Fatalf("bytes=0- cached: %d %s, %d bytes", r.status, r.xcache, len(r.body))
	}
	if r := f.get("/video", "Range", "bytes=524288-"); r.status != http.StatusPartialContent || r.body != string(body[524288:]) || r.xcache != CacheHit {
		t.Fatalf("seek cached: %d %s, %d bytes", r.status, r.xcache, len(r.body))
	}
	mu.Lock()
	defer mu.Unlock()
	if len(ranges) != 1 || ranges[0] != "" {
		t.Fatalf("origin requests with Range %q, want one without", ranges)
	}
}

// TestRangeFromFirstByteOnAFailure: when the whole object's fetch fails,
// the request that started it gets the failure, as any leader does, and
// an origin that refuses every byte still answers once.
func TestRangeFromFirstByteOnAFailure(t *testing.T) {
	var n int
	var mu sync.Mutex
	f := newFixture(t, Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		n++
		mu.Unlock()
		http.Error(w, "gone", http.StatusNotFound)
	}))
	r := f.get("/missing", "Range", "bytes=0-")
	if r.status != http.StatusNotFound || r.xcache != CacheMiss {
		t.Fatalf("got %d %s, %v", r.status, r.xcache, r.err)
	}
	mu.Lock()
	defer mu.Unlock()
	if n != 1 {
		t.Fatalf("origin asked %d times", n)
	}
}
