package metrics

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// stuckWriter is a scrape's client that does not read: its first Write
// says so on started and blocks until release closes. Its handler keeps
// its scrape slot, and the collection it read from, meanwhile.
type stuckWriter struct {
	httptest.ResponseRecorder
	started chan struct{}
	once    sync.Once
	release chan struct{}
}

func newStuckWriter(release chan struct{}) *stuckWriter {
	return &stuckWriter{ResponseRecorder: *httptest.NewRecorder(), started: make(chan struct{}), release: release}
}

func (w *stuckWriter) Write(p []byte) (int, error) {
	w.once.Do(func() { close(w.started) })
	<-w.release
	return w.ResponseRecorder.Write(p)
}

// collections is a collector that counts the times it is read and shows
// the count as onceproxy_test_collections.
func collections(m *Metrics) *atomic.Int64 {
	n := new(atomic.Int64)
	m.Register(NewVec("test_collections", "Collections so far.", false, nil, func(emit func(float64, ...string)) {
		emit(float64(n.Add(1)))
	}))
	return n
}

// TestOverlappingScrapesShareOneCollection: every scrape read every
// component's state anew (the upstream pool's under its lock), however
// many scrapes were running, so a scrape storm multiplied the reads. A
// scrape that overlaps another one is answered from its collection.
func TestOverlappingScrapesShareOneCollection(t *testing.T) {
	m := New(nil)
	n := collections(m)
	h := m.Handler()
	release := make(chan struct{})
	first := newStuckWriter(release)
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.ServeHTTP(first, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	}()
	select {
	case <-first.started: // collected, and writing its answer
	case <-time.After(time.Minute):
		t.Fatal("the first scrape wrote nothing")
	}
	for i := range 5 {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		if rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), "onceproxy_test_collections 1\n") {
			t.Fatalf("overlapping scrape %d: %d, want 200 with the first scrape's collection (onceproxy_test_collections 1); collections so far: %d",
				i+1, rec.Code, n.Load())
		}
	}
	close(release)
	<-done
	if got := n.Load(); got != 1 {
		t.Errorf("6 overlapping scrapes collected %d times, want 1", got)
	}
	// A scrape after them all collects anew.
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if !strings.Contains(rec.Body.String(), "onceproxy_test_collections 2\n") {
		t.Errorf("a later scrape did not collect anew:\n%.300s", rec.Body)
	}
}

// TestScrapesBeyondTheLimitRefused: nothing bounded the scrapes served at
// once, each encoding (and compressing) its answer and holding its
// goroutine while its client read. Past MaxScrapes a scrape is answered
// 503 at once, saying why.
func TestScrapesBeyondTheLimitRefused(t *testing.T) {
	m := New(nil)
	collections(m)
	h := m.Handler()
	release := make(chan struct{})
	var wg sync.WaitGroup
	defer wg.Wait()
	defer close(release)
	for range MaxScrapes {
		w := newStuckWriter(release)
		wg.Go(func() { h.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/metrics", nil)) })
		select {
		case <-w.started:
		case <-time.After(time.Minute):
			t.Fatal("a scrape within the limit wrote nothing")
		}
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if rec.Code != http.StatusServiceUnavailable || !strings.Contains(rec.Body.String(), "Limit of concurrent requests") {
		t.Errorf("scrape %d while %d are served: %d, want 503 saying why\n%.300s", MaxScrapes+1, MaxScrapes, rec.Code, rec.Body)
	}
}
