package pgstore

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fleettest"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// startBehindRelay starts an instance that reaches the database through
// a relay the test can cut or mute.
func (f *fleetFixture) startBehindRelay(name string, pc Config, dc dedup.Config) (*instance, *testkit.Relay) {
	f.t.Helper()
	u, err := url.Parse(f.url)
	if err != nil {
		f.t.Fatal(err)
	}
	relay := testkit.StartRelay(f.t, u.Host)
	direct := f.url
	u.Host = relay.Addr()
	f.url = u.String()
	defer func() { f.url = direct }()
	return f.start(name, pc, dc), relay
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
	a, relay := f.startBehindRelay("a", Config{BreakerInterval: 200 * time.Millisecond, BreakerFailures: 1}, dedup.Config{TTL: time.Hour})

	first := b.get(f.origin.URL + "/page")
	relay.Cut(true)
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
	relay.Cut(false)
	waitFor(t, "A to be back and share what it cached", func() bool {
		return a.be.Available() && a.store.pending.len() == 0
	})
	after := b.get(f.origin.URL + "/page")
	if after.body == before.body || after.body == first.body {
		t.Errorf("B after the purge serves %q (%s), fetched before the purge (first %q, A's %q)", after.body, after.xcache, first.body, before.body)
	}
}

// TestStatsLostAnswerCountsOnce: a flush whose answer the network lost
// (the database added it) is sent again, as it was, and the stats_added
// table makes the database add it only once; a flush that never reached
// it is sent again until it does.
func TestStatsLostAnswerCountsOnce(t *testing.T) {
	f := newFleet(t, 0, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {})
	a, relay := f.startBehindRelay("a", Config{StatsFlush: time.Hour, BreakerFailures: 5}, dedup.Config{})
	ctx := context.Background()
	conn := f.conn()
	fleettest.StatsLostAnswerCountsOnce(t, fleettest.StatsLink{
		Relay:  relay,
		Counts: &a.bus.stats,
		Flush:  func() { a.bus.flushOnce(ctx) },
		Stored: func(col string) (n int64) {
			err := conn.QueryRow(ctx, schemaSQL(f.schema, `SELECT coalesce(sum(`+col+`), 0) FROM {s}.stats`)).Scan(&n)
			if err != nil {
				t.Fatal(err)
			}
			return n
		},
	})
}
