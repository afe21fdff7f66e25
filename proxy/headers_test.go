package proxy

import (
	"net/http"
	"testing"
)

// TestHopHeadersAreCanonical: removeHopHeaders deletes hopHeaders from the
// map by their spelling, so a name that is not canonical would never be
// removed.
func TestHopHeadersAreCanonical(t *testing.T) {
	for _, name := range hopHeaders {
		if c := http.CanonicalHeaderKey(name); c != name {
			t.Errorf("hop header %q is not canonical (%q)", name, c)
		}
	}
	h := http.Header{}
	for _, name := range hopHeaders {
		h.Set(name, "x")
	}
	h.Set("Accept", "*/*")
	removeHopHeaders(h, false)
	if len(h) != 1 || h.Get("Accept") != "*/*" {
		t.Errorf("after removeHopHeaders: %v", h)
	}
}
