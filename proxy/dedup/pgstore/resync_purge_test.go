package pgstore

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// cutRelay forwards TCP to target until cut, and again after heal.
type cutRelay struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	cut    bool
	conns  []net.Conn
}

func newCutRelay(t *testing.T, target string) *cutRelay {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &cutRelay{ln: ln, target: target}
	t.Cleanup(func() { ln.Close(); r.setCut(true) })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			r.mu.Lock()
			if r.cut {
				r.mu.Unlock()
				c.Close()
				continue
			}
			u, err := net.Dial("tcp", target)
			if err != nil {
				r.mu.Unlock()
				c.Close()
				continue
			}
			r.conns = append(r.conns, c, u)
			r.mu.Unlock()
			go func() { io.Copy(u, c); u.Close() }()
			go func() { io.Copy(c, u); c.Close() }()
		}
	}()
	return r
}

func (r *cutRelay) setCut(cut bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cut = cut
	if cut {
		for _, c := range r.conns {
			c.Close()
		}
		r.conns = nil
	}
}

// TestPurgeDuringAPartitionIsNotUndone: instance A, cut off from
// PostgreSQL, fetches a URL and keeps it for its whole TTL; meanwhile the
// URL is purged through instance B (the fleet's row goes). Once A is back,
// what it fetched before the purge must not become the fleet's value.
func TestPurgeDuringAPartitionIsNotUndone(t *testing.T) {
	var n atomic.Int64
	f := newFleet(t, 1, Config{BreakerInterval: 200 * time.Millisecond, BreakerFailures: 1}, dedup.Config{TTL: time.Hour},
		func(w http.ResponseWriter, r *http.Request) { fmt.Fprintf(w, "%s #%d", r.URL.Path, n.Add(1)) })
	b := f.insts[0]
	u, err := url.Parse(f.url)
	if err != nil {
		t.Fatal(err)
	}
	relay := newCutRelay(t, u.Host)
	direct := f.url
	u.Host = relay.ln.Addr().String()
	f.url = u.String()
	a := f.start("a", Config{BreakerInterval: 200 * time.Millisecond, BreakerFailures: 1}, dedup.Config{TTL: time.Hour})
	f.url = direct

	first := b.get(f.origin.URL + "/page")
	relay.setCut(true)
	waitFor(t, "A's breaker to open", func() bool {
		a.get(fmt.Sprintf("%s/probe/%d", f.origin.URL, time.Now().UnixNano()))
		return !a.be.Available()
	})
	before := a.get(f.origin.URL + "/page") // fetched by A, cut off: kept for the outage
	if before.xcache != dedup.CacheBypass {
		t.Fatalf("A while cut off: %+v, want BYPASS", before)
	}
	time.Sleep(10 * time.Millisecond)
	// The page changed: the operator purges it, through B.
	if _, err := b.engine.InvalidateURL(context.Background(), f.origin.URL+"/page"); err != nil {
		t.Fatal(err)
	}
	relay.setCut(false)
	waitFor(t, "A to be back and share what it cached", func() bool {
		return a.be.Available() && a.store.pending.len() == 0
	})
	after := b.get(f.origin.URL + "/page")
	if after.body == before.body || after.body == first.body {
		t.Errorf("B after the purge serves %q (%s), fetched before the purge (first %q, A's %q)", after.body, after.xcache, first.body, before.body)
	}
}
