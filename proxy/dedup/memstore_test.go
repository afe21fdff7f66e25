package dedup

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

func entry(body int, urlKey string) *Entry {
	return &Entry{Status: 200, Header: http.Header{"Content-Type": {"text/plain"}}, Body: make([]byte, body), StoredAt: time.Now(), URLKey: urlKey}
}

// TestMemoryStoreByteBoundUnderChurn writes 8 MiB of distinct entries into
// a 1 MiB store: it must never hold more than its bound.
func TestMemoryStoreByteBoundUnderChurn(t *testing.T) {
	const maxBytes = 1 << 20
	s := NewMemoryStore(maxBytes)
	defer s.Close()
	ctx := context.Background()
	for i := range 2048 {
		if err := s.Set(ctx, fmt.Sprintf("k%d", i), entry(4096, "u"), time.Hour); err != nil {
			t.Fatal(err)
		}
		if i%256 == 0 {
			s.c.CleanUp()
			if st := s.Stats(); st.Bytes > maxBytes {
				t.Fatalf("after %d writes the store holds %d bytes > %d", i+1, st.Bytes, maxBytes)
			}
		}
	}
	s.c.CleanUp()
	st := s.Stats()
	if st.Bytes > maxBytes || st.Entries >= 2048 || st.Evictions == 0 {
		t.Fatalf("bound not enforced: %+v", st)
	}
	t.Logf("after 8 MiB of writes: %+v", st)
}

func TestMemoryStoreTTL(t *testing.T) {
	s := NewMemoryStore(1 << 20)
	defer s.Close()
	ctx := context.Background()
	past := entry(10, "u")
	past.ExpiresAt = time.Now().Add(-time.Second)
	s.Set(ctx, "old", past, time.Hour)
	if _, err := s.Get(ctx, "old"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("expired entry served: %v", err)
	}
	s.Set(ctx, "new", entry(10, "u"), time.Hour)
	if _, err := s.Get(ctx, "new"); err != nil {
		t.Fatal(err)
	}
	s.Set(ctx, "zero", entry(10, "u"), 0)
	if _, err := s.Get(ctx, "zero"); !errors.Is(err, ErrNotFound) {
		t.Fatal("ttl 0 stored")
	}
}

func TestMemoryStoreDeleteURL(t *testing.T) {
	s := NewMemoryStore(1 << 20)
	defer s.Close()
	ctx := context.Background()
	for i := range 5 {
		s.Set(ctx, fmt.Sprintf("a%d", i), entry(10, "u1:a"), time.Hour)
	}
	s.Set(ctx, "b", entry(10, "u1:b"), time.Hour)
	if n, err := s.DeleteURL(ctx, "u1:a"); n != 5 || err != nil {
		t.Fatalf("DeleteURL = %d, %v", n, err)
	}
	if _, err := s.Get(ctx, "b"); err != nil {
		t.Fatal("other URL deleted")
	}
	if err := s.Delete(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(ctx, "b"); !errors.Is(err, ErrNotFound) {
		t.Fatal("Delete did not delete")
	}
}

// TestFullStoreStartsNoGoroutinePerEviction: in a full store every insert
// evicts, and what the store does about an eviction (count it) must not
// cost a goroutine each, as otter's OnDeletion does on its default
// executor (one per eviction: a full cache's every unique miss).
func TestFullStoreStartsNoGoroutinePerEviction(t *testing.T) {
	e := entry(2048, "u")
	s := fullStore(t, 1<<20, e)
	ctx := context.Background()
	const inserts = 4000
	evicted, started := s.Stats().Evictions, testkit.GoroutinesStarted()
	for i := range inserts {
		s.Set(ctx, "k"+strconv.Itoa(i), e, time.Hour)
	}
	s.c.CleanUp()
	evicted, started = s.Stats().Evictions-evicted, testkit.GoroutinesStarted()-started
	if evicted < inserts/2 {
		t.Fatalf("%d inserts into a full store evicted %d entries: the store is not full", inserts, evicted)
	}
	// otter's maintenance takes a goroutine now and then (2-4 per 100
	// inserts measured); one per eviction would be thousands.
	if started > evicted/4 {
		t.Errorf("%d inserts evicting %d entries started %d goroutines", inserts, evicted, started)
	}
	t.Logf("%d inserts, %d evictions, %d goroutines started", inserts, evicted, started)
}

// fullStore returns a store of maxBytes already full of copies of e, so
// that every further insert evicts; it is closed when tb ends.
func fullStore(tb testing.TB, maxBytes int64, e *Entry) *MemoryStore {
	s := NewMemoryStore(maxBytes)
	tb.Cleanup(s.Close)
	ctx := context.Background()
	for i := range 2 * maxBytes / int64(len(e.Body)) {
		s.Set(ctx, "fill"+strconv.FormatInt(i, 10), e, time.Hour)
	}
	s.c.CleanUp()
	return s
}

// BenchmarkMemoryStoreSetFull measures a full store's insert, each one
// evicting another entry, as a full cache's unique misses do; it reports
// the goroutines started per insert (otter's maintenance, and anything
// run on its executor).
//
//	go test -run '^$' -bench MemoryStoreSetFull -benchmem ./proxy/dedup/
func BenchmarkMemoryStoreSetFull(b *testing.B) {
	e := entry(2048, "u")
	s := fullStore(b, 4<<20, e)
	ctx := context.Background()
	keys := make([]string, b.N)
	for i := range keys {
		keys[i] = "k" + strconv.Itoa(i)
	}
	before := testkit.GoroutinesStarted()
	b.ResetTimer()
	for i := range b.N {
		s.Set(ctx, keys[i], e, time.Hour)
	}
	b.StopTimer()
	b.ReportMetric(float64(testkit.GoroutinesStarted()-before)/float64(b.N), "goroutines/op")
}
