package dedup

import (
	"context"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestRangeClientGivingUpStartsNoFetch: a Range request waits on a flight
// whose body has no declared length (its length comes with its end), and
// its client gives up. The request is over: it must not go on to the
// origin with its range, in a flight that runs detached from a client
// already gone.
func TestRangeClientGivingUpStartsNoFetch(t *testing.T) {
	body := pattern(512 << 10)
	gate := testkit.NewGate(t)
	f := newFixture(t, streamConfig(t, Config{MaxBodyBytes: 64 * bytesize.KiB}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Range") != "" {
			t.Errorf("Range request upstream from a client that had given up: %q", r.Header.Get("Range"))
			w.WriteHeader(http.StatusPartialContent)
			return
		}
		// No Content-Length: chunked.
		writeSlowly(w, body[:64<<10])
		gate.Wait(r.Context())
		writeSlowly(w, body[64<<10:])
	}))
	leader, err := f.open(context.Background(), "/chunked")
	if err != nil {
		t.Fatal(err)
	}
	defer leader.Body.Close()
	key := leader.Header.Get(HeaderCacheKey)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan result, 1)
	go func() { done <- f.do(ctx, http.MethodGet, "/chunked", http.Header{"Range": {"bytes=-100"}}, "") }()
	testkit.Eventually(t, testkit.Patience, func() bool { return f.interest(key) == 2 }, "the Range request on the flight")
	cancel()
	r := <-done
	if r.err == nil {
		t.Fatalf("a Range request whose client gave up got %d", r.status)
	}
	gate.Open()
	if _, err := io.ReadAll(leader.Body); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // a stray flight would have asked by now
	if n := f.up.n.Load(); n != 1 {
		t.Fatalf("upstream requests = %d, want 1", n)
	}
}
