package pgstore

import (
	"bytes"
	"context"
	"crypto/rand"
	"io"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/pgtest"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestBigBodyOnceAcrossTheFleet: a body too big for the table, asked for
// by clients on three instances, is downloaded once: the leader, holding
// the key's lock, names its peer listener in a row beside the flight's
// outcome; the others read the body from it as it arrives, byte for byte.
// The row outlives the flight by failure_ttl only.
func TestBigBodyOnceAcrossTheFleet(t *testing.T) {
	body := make([]byte, 3<<20)
	rand.Read(body)
	release := make(chan struct{})
	var n atomic.Int64
	url, schema := pgtest.Schema(t)
	f := &fleetFixture{t: t, url: url, schema: schema, peers: true}
	startFleet(t, f, 3, Config{MaxValueBytes: 64 << 10}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		rc := http.NewResponseController(w)
		first := n.Add(1) == 1
		for off := 0; off < len(body); off += 64 << 10 {
			if first && off == 512<<10 {
				<-release
			}
			if _, err := w.Write(body[off:min(off+64<<10, len(body))]); err != nil {
				return
			}
			rc.Flush()
		}
	})
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	a := f.insts[0]
	open := func(in *instance) *http.Response {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, f.origin.URL+"/big", nil)
		resp, err := in.engine.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { resp.Body.Close() })
		return resp
	}
	leader := open(a)
	var resps []*http.Response
	for range 3 {
		for _, in := range f.insts[1:] {
			resps = append(resps, open(in))
		}
	}
	key := leader.Header.Get(dedup.HeaderCacheKey)
	var rows int
	db := f.conn()
	ctx := context.Background()
	if err := db.QueryRow(ctx, schemaSQL(schema, `SELECT count(*) FROM {s}.outcomes WHERE key = $1 AND expires_at > now() + interval '1 minute'`), peerRowKey(key)).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != 1 {
		t.Fatalf("no row names the streaming leader's peer listener (%d)", rows)
	}
	close(release)
	for _, resp := range append(resps, leader) {
		if all, err := io.ReadAll(resp.Body); err != nil || !bytes.Equal(all, body) {
			t.Fatalf("client: %d bytes, %v", len(all), err)
		}
	}
	if f.hits.Load() != 1 {
		t.Fatalf("origin saw %d requests, want 1", f.hits.Load())
	}
	for _, in := range f.insts[1:] {
		if st := in.engine.Stats().PeerFetches; st != (dedup.PeerStats{OK: 1}) {
			t.Fatalf("%s peer fetches %+v, want one ok", in.name, st)
		}
	}
	for _, resp := range resps {
		if x := resp.Header.Get(dedup.HeaderCache); x != dedup.CacheCoalesced {
			t.Fatalf("follower's client: %s", x)
		}
	}
	// The row goes with the flight: failure_ttl, not an hour.
	if err := db.QueryRow(ctx, schemaSQL(schema, `SELECT count(*) FROM {s}.outcomes WHERE key = $1 AND expires_at > now() + interval '1 minute'`), peerRowKey(key)).Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("the peer row outlives the flight: %d, %v", rows, err)
	}
}

// TestPeerRow: what a peer row holds is read back only as written.
func TestPeerRow(t *testing.T) {
	inst, addr, ok := decodePeer(encodePeer("0123456789ab", "10.0.0.7:7070"))
	if !ok || inst != "0123456789ab" || addr != "10.0.0.7:7070" {
		t.Fatalf("round trip: %q %q %v", inst, addr, ok)
	}
	for _, b := range []string{"", "p1", "p1 ", "p1 x", "p1 x 10.0.0.7", "p2 x 10.0.0.7:1", "p1  10.0.0.7:1", "p1 x 10.0.0.7:0", "p1 x :80"} {
		if _, _, ok := decodePeer([]byte(b)); ok {
			t.Errorf("%q read as a peer row", b)
		}
	}
}
