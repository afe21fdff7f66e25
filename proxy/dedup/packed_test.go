package dedup

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"reflect"
	"runtime"
	"strconv"
	"testing"
	"time"
)

// TestPackRoundTrip: an entry comes back from its packed form as it went
// in: status, every header field with every value in order, Vary, URL
// key, body and times; empty and zero fields stay empty and zero.
func TestPackRoundTrip(t *testing.T) {
	now := time.Now()
	for _, e := range []*Entry{
		{
			Status: http.StatusOK,
			Header: http.Header{
				"Content-Type": {"text/html; charset=utf-8"},
				"Set-Cookie":   {"a=1", "b=2", ""},
				"X-Empty":      {""},
				"Etag":         {`"x"`},
			},
			Body:      []byte("<html>hello</html>"),
			StoredAt:  now,
			ExpiresAt: now.Add(45 * time.Second),
			URLKey:    "u1:0123",
			Vary:      []HeaderValue{{"Accept-Language", "de"}, {"User-Agent", ""}},
		},
		{Status: http.StatusNoContent, Header: http.Header{}},
		{Status: http.StatusNotFound, Header: http.Header{"X-Big": {string(bytes.Repeat([]byte("v"), 70000))}}, Body: bytes.Repeat([]byte{0}, 300)},
	} {
		p := pack("k", e)
		got := p.entry()
		if got.Status != e.Status || got.URLKey != e.URLKey || !bytes.Equal(got.Body, e.Body) {
			t.Errorf("status %d key %q body %q, want %d %q %q", got.Status, got.URLKey, got.Body, e.Status, e.URLKey, e.Body)
		}
		if !got.StoredAt.Equal(e.StoredAt) || !got.ExpiresAt.Equal(e.ExpiresAt) {
			t.Errorf("times %v %v, want %v %v", got.StoredAt, got.ExpiresAt, e.StoredAt, e.ExpiresAt)
		}
		if len(got.Header) != len(e.Header) {
			t.Errorf("header %q, want %q", got.Header, e.Header)
		}
		for k, vs := range e.Header {
			if !reflect.DeepEqual(got.Header[k], vs) {
				t.Errorf("header %s = %q, want %q", k, got.Header[k], vs)
			}
		}
		if !reflect.DeepEqual(got.Vary, e.Vary) && (len(got.Vary) != 0 || len(e.Vary) != 0) {
			t.Errorf("vary %q, want %q", got.Vary, e.Vary)
		}
		if got.Header == nil {
			t.Error("an entry without fields came back with a nil header map")
		}
	}
}

// TestPackedEntryIsReadOnly: what a client's answer does with the
// unpacked body or header slices never reaches the packed bytes the next
// hit unpacks.
func TestPackedEntryIsReadOnly(t *testing.T) {
	p := pack("k", &Entry{Status: 200, Header: http.Header{"A": {"1", "2"}, "B": {"3"}}, Body: []byte("body")})
	e := p.entry()
	_ = append(e.Body, "tail"...)
	e.Header["A"] = append(e.Header["A"], "x")
	e.Header.Add("B", "y")
	e.Header.Set("C", "z")
	again := p.entry()
	if string(again.Body) != "body" || !reflect.DeepEqual(again.Header, http.Header{"A": {"1", "2"}, "B": {"3"}}) {
		t.Fatalf("the packed entry changed: %q %q", again.Body, again.Header)
	}
}

// TestFlightEntryIsStoredAsRead: an entry a flight built in its packed
// form (its body read into it) is stored without being packed again, and
// a hit reads the same bytes.
func TestFlightEntryIsStoredAsRead(t *testing.T) {
	s := NewMemoryStore(1 << 20)
	defer s.Close()
	e := &Entry{Status: 200, Header: http.Header{"Content-Length": {"4"}}, StoredAt: time.Now()}
	p, body := packHead("k", e, 4)
	copy(body, "data")
	e.Body, e.packed = body, p
	if err := s.Set(context.Background(), "k", e, time.Minute); err != nil {
		t.Fatal(err)
	}
	stored, ok := s.c.GetIfPresent("k")
	if !ok || &stored.data[0] != &p.data[0] {
		t.Fatal("the store packed the entry again instead of keeping its bytes")
	}
	got, err := s.Get(context.Background(), "k")
	if err != nil || string(got.Body) != "data" || got.Header.Get("Content-Length") != "4" {
		t.Fatalf("Get = %v, %v", got, err)
	}
}

// TestMemoryStoreKeepsFewObjects is why entries are packed: a cache full
// of responses with a dozen header fields each must cost the collector a
// few objects per entry, not a map, slices and strings per field.
func TestMemoryStoreKeepsFewObjects(t *testing.T) {
	const n = 5000
	s := NewMemoryStore(1 << 30)
	defer s.Close()
	ctx := context.Background()
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("v1:%064d", i)
	}
	before := heap().HeapObjects
	for i, k := range keys {
		if err := s.Set(ctx, k, page(i, 512, 12), time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	s.c.CleanUp()
	// What the store retains: the entries as built are garbage now.
	per := float64(heap().HeapObjects-before) / n
	if got := s.c.EstimatedSize(); got != n {
		t.Fatalf("store holds %d entries, want %d", got, n)
	}
	// otter's node (with the packed struct in it), the packed bytes, and
	// a share of otter's own tables; the keys were there before.
	if per > 4 {
		t.Errorf("%.1f live objects per stored entry, want at most 4", per)
	}
	t.Logf("%.2f live objects per stored entry", per)
	runtime.KeepAlive(keys)
}

// heap is the runtime's heap after a collection: what is live.
func heap() runtime.MemStats {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m
}

// page is the i-th cached page of size bytes, with a typical header and
// fields more fields of its own.
func page(i, size, fields int) *Entry {
	h := http.Header{
		"Content-Type":     {"text/html; charset=utf-8"},
		"Content-Length":   {strconv.Itoa(size)},
		"Date":             {"Wed, 02 Dec 2026 05:40:01 GMT"},
		"X-Origin-Request": {strconv.Itoa(i)},
	}
	for f := range fields {
		h["X-Field-"+strconv.Itoa(f)] = []string{fmt.Sprintf("value %d of entry %d", f, i)}
	}
	return &Entry{Status: 200, Header: h, Body: make([]byte, size), URLKey: fmt.Sprintf("u1:%064d", i), StoredAt: time.Now()}
}

// BenchmarkFullCacheCollection measures what a memory store full of small
// pages (100,000 entries of 2 KiB with a typical header, about 256 MiB
// with overhead) costs each garbage collection: ns/op is one whole
// collection, which the process pays every few tens of thousands of
// requests at steady state.
//
//	go test -run '^$' -bench FullCacheCollection -benchtime 20x ./proxy/dedup/
func BenchmarkFullCacheCollection(b *testing.B) {
	const n = 100_000
	s := NewMemoryStore(1 << 40)
	defer s.Close()
	ctx := context.Background()
	for i := range n {
		if err := s.Set(ctx, fmt.Sprintf("v1:%064d", i), page(i, 2048, 1), time.Hour); err != nil {
			b.Fatal(err)
		}
	}
	s.c.CleanUp()
	runtime.GC()
	b.ResetTimer()
	for b.Loop() {
		runtime.GC()
	}
	b.StopTimer()
	b.ReportMetric(float64(heap().HeapObjects)/n, "objects/entry")
}

// TestMemoryStoreWeighsWhatItHolds: the store's bound is on memory, so an
// entry's weight must be what it costs the heap (its packed bytes as
// allocated, rounded up to the runtime's size class, and otter's node),
// within a tenth, whatever the body's size.
func TestMemoryStoreWeighsWhatItHolds(t *testing.T) {
	for _, size := range []int{300, 2048, 4096, 20000} {
		const n = 4000
		s := NewMemoryStore(1 << 40)
		keys := make([]string, n)
		for i := range keys {
			keys[i] = fmt.Sprintf("v1:%064d", i)
		}
		before := heap().HeapAlloc
		for i, k := range keys {
			if err := s.Set(context.Background(), k, page(i, size, 0), time.Hour); err != nil {
				t.Fatal(err)
			}
		}
		s.c.CleanUp()
		real, weight := float64(heap().HeapAlloc-before)/n, float64(s.c.WeightedSize())/n
		if real > 1.1*weight || real < 0.9*weight {
			t.Errorf("%d-byte bodies: %.0f bytes of heap per entry, weighed %.0f", size, real, weight)
		}
		runtime.KeepAlive(keys)
		s.Close()
	}
}

// TestHitsDoNotShareHeaders: a hit's response takes the header map its
// entry was unpacked with, so what one client's answer does to its header
// (the proxy adds and removes fields) must reach no other hit.
func TestHitsDoNotShareHeaders(t *testing.T) {
	f := newFixture(t, Config{TTL: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Origin", "o")
		okHandler(w, r)
	}))
	if r := f.get("/a"); r.xcache != CacheMiss {
		t.Fatalf("first: %+v", r)
	}
	get := func() *http.Response {
		req, _ := http.NewRequest(http.MethodGet, f.origin.URL+"/a", nil)
		resp, err := f.eng.RoundTrip(req)
		if err != nil || resp.Header.Get(HeaderCache) != CacheHit {
			t.Fatalf("hit: %v, %v", resp, err)
		}
		return resp
	}
	one := get()
	one.Header.Set("X-Mutated", "1")
	one.Header.Del("X-Origin")
	two := get()
	if two.Header.Get("X-Mutated") != "" || two.Header.Get("X-Origin") != "o" {
		t.Fatalf("a hit's header changes reached the next hit: %v", two.Header)
	}
	if one.Header.Get("X-Origin") != "" {
		t.Fatal("the first answer's own change did not stick")
	}
}
