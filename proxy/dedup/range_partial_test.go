package dedup

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestRangeNotCutFromAPartialObject: an origin that answers a plain GET
// with 206 (a part of the object, say its first 256 KiB) gives the flight
// a body that is not the whole object. A Range request for bytes that part
// does not hold must not get that part (another range than it asked for:
// a resuming downloader that appends without checking Content-Range ends
// with a corrupt file); it goes upstream with its own range.
func TestRangeNotCutFromAPartialObject(t *testing.T) {
	const total = 1 << 20
	const part = 256 << 10
	body := pattern(total)
	gate := testkit.NewGate(t)
	f := newFixture(t, streamConfig(t, Config{MaxBodyBytes: 64 * bytesize.KiB, CacheableStatuses: []int{200, 206}}),
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if rg := r.Header.Get("Range"); rg != "" {
				// Honour the one range the test asks for.
				if rg != "bytes=600000-600099" {
					t.Errorf("unexpected Range upstream: %q", rg)
					return
				}
				w.Header().Set("Content-Range", "bytes 600000-600099/"+strconv.Itoa(total))
				w.Header().Set("Content-Length", "100")
				w.WriteHeader(http.StatusPartialContent)
				w.Write(body[600000:600100])
				return
			}
			// A plain GET answered with a part.
			w.Header().Set("Content-Range", "bytes 0-"+strconv.Itoa(part-1)+"/"+strconv.Itoa(total))
			w.Header().Set("Content-Length", strconv.Itoa(part))
			w.WriteHeader(http.StatusPartialContent)
			writeSlowly(w, body[:64<<10])
			gate.Wait(r.Context())
			writeSlowly(w, body[64<<10:part])
		}))
	leader, err := f.open(context.Background(), "/file")
	if err != nil {
		t.Fatal(err)
	}
	defer leader.Body.Close()
	check := func(r result, when string) {
		t.Helper()
		if r.err != nil || r.status != http.StatusPartialContent || r.header.Get("Content-Range") != "bytes 600000-600099/1048576" || r.body != string(body[600000:600100]) {
			t.Fatalf("%s: Range bytes=600000-600099 got %d %q, %d bytes, X-Cache %s, err %v", when,
				r.status, r.header.Get("Content-Range"), len(r.body), r.xcache, r.err)
		}
	}
	// In flight.
	check(f.get("/file", "Range", "bytes=600000-600099"), "in flight")
	gate.Open()
	if _, err := io.ReadAll(leader.Body); err != nil {
		t.Fatal(err)
	}
	leader.Body.Close()
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.flights.running() == 0 }, "the download to end")
	// Cached (206 is cacheable here).
	check(f.get("/file", "Range", "bytes=600000-600099"), "cached")
}
