package dedup

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"strconv"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestRangeOnABodyThatTurnsIntoARelay: a Range request joins a flight whose
// body has no declared length and waits for that length; the body then
// grows past max_object_bytes and is relayed. The relay waits for every
// request on the flight to read, and the Range request reads nothing
// before the end: it used to hold the relay, and with it the leader's
// client, until the Range client gave up. Now it leaves the relayed body
// (its start is gone anyway) and goes upstream with its range.
func TestRangeOnABodyThatTurnsIntoARelay(t *testing.T) {
	const size = 512 << 10
	body := pattern(size)
	release := make(chan struct{})
	f := newFixture(t, streamConfig(t, Config{MaxBodyBytes: 16 * bytesize.KiB, MaxObjectBytes: 64 * bytesize.KiB}),
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Range") == "bytes=0-9" {
				w.Header().Set("Content-Range", "bytes 0-9/"+strconv.Itoa(size))
				w.WriteHeader(http.StatusPartialContent)
				w.Write(body[:10])
				return
			}
			// No Content-Length: chunked, of unknown length.
			writeSlowly(w, body[:8<<10])
			<-release
			writeSlowly(w, body[8<<10:])
		}))
	// Deadlock guard only: nothing here is timed.
	ctx, cancel := context.WithTimeout(context.Background(), testkit.Patience)
	defer cancel()
	leader, err := f.open(ctx, "/stream")
	if err != nil {
		t.Fatal(err)
	}
	defer leader.Body.Close()
	key := leader.Header.Get(HeaderCacheKey)

	ranged := make(chan result, 1)
	go func() { ranged <- f.do(ctx, http.MethodGet, "/stream", http.Header{"Range": {"bytes=0-9"}}, "") }()
	testkit.Eventually(t, testkit.Patience, func() bool { return f.interest(key) == 2 }, "the Range request on the flight")
	close(release)

	got, err := io.ReadAll(leader.Body)
	if err != nil || !bytes.Equal(got, body) {
		t.Fatalf("leader read %d of %d bytes, err %v", len(got), size, err)
	}
	leader.Body.Close()
	r := <-ranged
	if r.err != nil || r.status != http.StatusPartialContent || r.xcache != CacheMiss || r.body != string(body[:10]) {
		t.Fatalf("Range request: status %d, %d bytes, X-Cache %s, err %v", r.status, len(r.body), r.xcache, r.err)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.Stats().Spool.Active == 0 }, "every spool let go")
}
