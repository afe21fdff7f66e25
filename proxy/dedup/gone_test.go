package dedup

import (
	"context"
	"errors"
	"io"
	"net/http"
	"testing"
)

// TestGoneClientLeadsNothing: a request whose client is already gone when
// it reaches the engine (it hung up while the proxy read its head, or
// while its turn at a rate limit came) starts no flight: the fetch would
// run detached from it, for nobody, and take a flight slot.
func TestGoneClientLeadsNothing(t *testing.T) {
	f := newFixture(t, Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "page")
	}))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	r := f.do(ctx, http.MethodGet, "/gone", nil, "")
	if !errors.Is(r.err, context.Canceled) {
		t.Fatalf("request of a gone client: status %d, err %v; want context.Canceled", r.status, r.err)
	}
	// Close waits for every flight started: one started for this request
	// has asked upstream by the time it returns.
	f.eng.Close()
	if n := f.up.n.Load(); n != 0 {
		t.Fatalf("upstream requests = %d, want 0", n)
	}
}
