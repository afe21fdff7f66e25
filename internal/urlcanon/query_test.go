package urlcanon

import (
	"fmt"
	"net/url"
	"strings"
	"testing"
)

// TestAppendManyEscapedNamesAllocs: sorting a query compares names as a
// form decoder reads them. Decoding a name used to allocate in every
// comparison, so a request head of thousands of escaped names (a 64 KiB
// head holds 7,000) cost a hundred thousand allocations, over a CPU
// second per MiB of query; each comparison now decodes into reused
// buffers.
func TestAppendManyEscapedNamesAllocs(t *testing.T) {
	const n = 2000
	var q strings.Builder
	for i := range n {
		if i > 0 {
			q.WriteByte('&')
		}
		// Descending, so that the sort has work to do; '+' and an escape
		// make each name one a form decoder reads differently.
		fmt.Fprintf(&q, "p+%04d%%5B%%5D=%d", n-i, i)
	}
	u := &url.URL{Scheme: "http", Host: "e.com", RawQuery: q.String()}
	buf := make([]byte, 0, 64<<10)
	allocs := testing.AllocsPerRun(5, func() {
		if _, err := Append(buf[:0], u, trackingParams); err != nil {
			t.Fatal(err)
		}
	})
	if allocs > 20 {
		t.Errorf("Append of %d escaped query names: %.0f allocations, want at most 20", n, allocs)
	}
	got, _ := Append(nil, u, nil)
	if !strings.HasPrefix(string(got), "http://e.com/?p+0001%5B%5D=1999&p+0002%5B%5D=1998&") {
		t.Errorf("Append sorted the query as %.80q...", got)
	}
}
