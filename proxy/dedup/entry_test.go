package dedup

import (
	"net/http"
	"slices"
	"testing"
)

// TestServedHeaderLeavesTheEntryAlone: a response built from an entry
// shares the entry's header values, so whatever the proxy then does to
// the response's header (an Add to a field with room left in its slice,
// a Set, a Del) must not reach the entry that later hits are served from.
func TestServedHeaderLeavesTheEntryAlone(t *testing.T) {
	vals := make([]string, 2, 8) // room to append in place
	vals[0], vals[1] = "a=1", "b=2"
	ent := &Entry{Status: http.StatusOK, Header: http.Header{"Set-Cookie": vals, "Etag": {`"x"`}}, Body: []byte("hi")}
	req, _ := http.NewRequest(http.MethodGet, "http://example.test/", nil)

	resp := ent.response(req, nil, nil)
	resp.Header.Add("Set-Cookie", "c=3")
	resp.Header.Set("Etag", `"y"`)
	resp.Header.Del("Set-Cookie")
	resp.Header.Add("Set-Cookie", "d=4")
	markCache(resp.Header, CacheHit, "k")

	if got := ent.Header["Set-Cookie"]; !slices.Equal(got, []string{"a=1", "b=2"}) {
		t.Errorf("entry's Set-Cookie = %q after the response was changed", got)
	}
	if got := vals[:3][2]; got != "" {
		t.Errorf("the response appended %q into the entry's slice", got)
	}
	if got := ent.Header.Get("Etag"); got != `"x"` {
		t.Errorf("entry's Etag = %q", got)
	}
	if ent.Header.Get(HeaderCache) != "" {
		t.Error("X-Cache reached the entry")
	}
	second := ent.response(req, nil, nil)
	if got := second.Header["Set-Cookie"]; !slices.Equal(got, []string{"a=1", "b=2"}) {
		t.Errorf("the next response's Set-Cookie = %q", got)
	}
}
