package testkit

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestPoll(t *testing.T) {
	var n atomic.Int32
	if !Poll(time.Minute, func() bool { return n.Add(1) == 3 }) || n.Load() != 3 {
		t.Fatalf("Poll stopped after %d checks, want 3", n.Load())
	}
	start := time.Now()
	if Poll(20*time.Millisecond, func() bool { return false }) {
		t.Fatal("Poll reported a condition that never held")
	}
	if time.Since(start) < 20*time.Millisecond {
		t.Fatal("Poll gave up before its timeout")
	}
}

func TestDeadAddr(t *testing.T) {
	addr := DeadAddr(t)
	if c, err := net.DialTimeout("tcp", addr, 5*time.Second); err == nil {
		c.Close()
		t.Fatalf("something listens on %s", addr)
	}
}

func TestGetJSON(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/ok":
			w.Write([]byte(`{"n": 7}`))
		case "/garbage":
			w.Write([]byte(`not json`))
		default:
			http.Error(w, "no such thing", http.StatusNotFound)
		}
	}))
	defer srv.Close()
	var v struct{ N int }
	if err := GetJSON(srv.URL+"/ok", &v); err != nil || v.N != 7 {
		t.Fatalf("GetJSON /ok: %+v, %v", v, err)
	}
	if err := GetJSON(srv.URL+"/garbage", &v); err == nil || !strings.Contains(err.Error(), "decode") {
		t.Errorf("GetJSON /garbage: err = %v", err)
	}
	if err := GetJSON(srv.URL+"/missing", &v); err == nil || !strings.Contains(err.Error(), "404") || !strings.Contains(err.Error(), "no such thing") {
		t.Errorf("GetJSON /missing: err = %v", err)
	}
}

func TestServerPort(t *testing.T) {
	lo := ephemeralLow()
	seen := map[int]bool{}
	for range 20 {
		p := ServerPort(t)
		if p < 1024 || p >= lo {
			t.Fatalf("port %d outside [1024, %d)", p, lo)
		}
		seen[p] = true
	}
	if len(seen) < 10 {
		t.Errorf("20 draws gave %d distinct ports: not spread", len(seen))
	}
}

func TestGate(t *testing.T) {
	var g *Gate
	t.Run("inner", func(t *testing.T) {
		g = NewGate(t)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if g.Wait(ctx) {
			t.Fatal("a closed gate let a waiter with a cancelled context through as if open")
		}
	})
	// The inner test's cleanup opened it.
	ctx, cancel := context.WithTimeout(context.Background(), Patience)
	defer cancel()
	if !g.Wait(ctx) {
		t.Fatal("gate not open after its test ended")
	}
	g.Open() // a second Open is harmless
}

func TestGoroutinesStartedCounts(t *testing.T) {
	before := GoroutinesStarted()
	var wg sync.WaitGroup
	for range 10 {
		wg.Go(func() {})
	}
	wg.Wait()
	if got := GoroutinesStarted() - before; got < 10 {
		t.Fatalf("10 goroutines started, GoroutinesStarted rose by %d", got)
	}
}
