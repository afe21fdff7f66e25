package dedup

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"
)

// BenchmarkHit measures the cache-hit path of the engine alone: key,
// lookup, a fresh response with its own header map and body reader.
func BenchmarkHit(b *testing.B) {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Header().Set("Cache-Control", "max-age=60")
		w.Write(make([]byte, 16<<10))
	}))
	defer origin.Close()
	cfg := Config{Enabled: true, TTL: time.Hour}.WithDefaults()
	store := NewMemoryStore(64 << 20)
	defer store.Close()
	eng, err := New(cfg, Options{Store: store, Next: http.DefaultTransport, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	defer eng.Close()
	req, _ := http.NewRequest(http.MethodGet, origin.URL+"/product/123?color=red&size=m&utm_source=x&page=2&sort=asc", nil)
	req.Header.Set("Accept", "text/html,application/xhtml+xml")
	req.Header.Set("Accept-Language", "en-US,en;q=0.9")
	req.Header.Set("Accept-Encoding", "gzip, br")
	req.Header.Set("Cookie", "session=abc; theme=dark; consent=1")
	req.Header.Set("User-Agent", "Mozilla/5.0 (X11; Linux x86_64)")
	if resp, err := eng.RoundTrip(req); err != nil {
		b.Fatal(err)
	} else {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		resp, err := eng.RoundTrip(req)
		if err != nil {
			b.Fatal(err)
		}
		if resp.Header.Get(HeaderCache) != CacheHit {
			b.Fatal("not a hit")
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}

// BenchmarkStreamReaders measures one big object (16 MiB, over
// max_body_bytes: it spools to a file) delivered to 1, 10 and 100
// concurrent readers of one flight, from a loopback origin; each
// iteration is a fresh URL, so a fresh download. Bytes/s counts what all
// readers received.
func BenchmarkStreamReaders(b *testing.B) {
	const size = 16 << 20
	body := pattern(size)
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(size))
		w.Write(body)
	}))
	defer origin.Close()
	for _, readers := range []int{1, 10, 100} {
		b.Run(strconv.Itoa(readers), func(b *testing.B) {
			cfg := Config{Enabled: true, TTL: 0, SpoolDir: b.TempDir()}.WithDefaults()
			store := NewMemoryStore(64 << 20)
			defer store.Close()
			tr := &http.Transport{DisableCompression: true}
			defer tr.CloseIdleConnections()
			eng, err := New(cfg, Options{Store: store, Next: tr, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
			if err != nil {
				b.Fatal(err)
			}
			defer eng.Close()
			b.SetBytes(int64(size * readers))
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				i++
				url := origin.URL + "/obj?i=" + strconv.Itoa(i)
				var wg sync.WaitGroup
				for range readers {
					wg.Go(func() {
						req, _ := http.NewRequest(http.MethodGet, url, nil)
						resp, err := eng.RoundTrip(req)
						if err != nil {
							b.Error(err)
							return
						}
						if n, err := io.Copy(io.Discard, resp.Body); err != nil || n != size {
							b.Errorf("read %d bytes, %v", n, err)
						}
						resp.Body.Close()
					})
				}
				wg.Wait()
			}
		})
	}
}

// BenchmarkPeerFetch measures one big object (16 MiB, over max_body_bytes:
// spooled to a file on both sides) read by another instance's flight from
// the leader's peer listener as the leader downloads it, and from there
// by 1 or 10 readers: the bytes per second are the follower's readers'.
func BenchmarkPeerFetch(b *testing.B) {
	const size = 16 << 20
	body := pattern(size)
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(size))
		w.Write(body)
	}))
	defer origin.Close()
	for _, readers := range []int{1, 10} {
		b.Run(strconv.Itoa(readers), func(b *testing.B) {
			insts := peerFleet(b, 2, origin, Config{MaxBodyBytes: 1 << 20}, nil)
			a, f := insts[0], insts[1]
			b.SetBytes(int64(size * readers))
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				i++
				url := origin.URL + "/obj?i=" + strconv.Itoa(i)
				leader, err := a.open(context.Background(), url)
				if err != nil {
					b.Fatal(err)
				}
				var wg sync.WaitGroup
				wg.Go(func() { io.Copy(io.Discard, leader.Body); leader.Body.Close() })
				for range readers {
					wg.Go(func() {
						resp, err := f.open(context.Background(), url)
						if err != nil {
							b.Error(err)
							return
						}
						if n, err := io.Copy(io.Discard, resp.Body); err != nil || n != size {
							b.Errorf("read %d bytes, %v", n, err)
						}
						resp.Body.Close()
					})
				}
				wg.Wait()
			}
			if st := f.eng.Stats().PeerFetches; st.OK == 0 || st.Fallback+st.Failed != 0 {
				b.Fatalf("follower's peer fetches %+v", st)
			}
		})
	}
}
