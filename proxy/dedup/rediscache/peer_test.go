package rediscache

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// newPeerFleet is newFleet with every instance on a peer listener.
func newPeerFleet(t *testing.T, n int, rc Config, dc dedup.Config, h http.HandlerFunc) *fleetFixture {
	t.Helper()
	return startFleet(t, &fleetFixture{peers: true}, n, rc, dc, h)
}

// heldBody serves body with its length: to its first request the first
// held bytes, then the rest once release is closed; to later ones all of
// it.
func heldBody(body []byte, held int, release <-chan struct{}) http.HandlerFunc {
	var n atomic.Int64
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.Header().Set("Content-Type", "application/octet-stream")
		rc := http.NewResponseController(w)
		write := func(b []byte) {
			for len(b) > 0 {
				k := min(len(b), 64<<10)
				if _, err := w.Write(b[:k]); err != nil {
					return
				}
				rc.Flush()
				b = b[k:]
			}
		}
		if n.Add(1) > 1 {
			write(body)
			return
		}
		write(body[:held])
		<-release
		write(body[held:])
	}
}

// openAt sends a GET through the instance's engine and returns the
// response with its body unread.
func (i *instance) openAt(url string) (*http.Response, error) {
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	return i.engine.RoundTrip(req)
}

// TestBigBodyOnceAcrossTheFleet: a body too big for Redis, asked for by
// clients on three instances, is downloaded once: the leader keeps its
// lease and names its peer listener with it, the clients waiting on the
// other instances and those arriving there in the middle of the download
// read it from the leader as it arrives, byte for byte, and each follower
// caches its copy. Nothing of it goes into Redis.
func TestBigBodyOnceAcrossTheFleet(t *testing.T) {
	body := make([]byte, 3<<20)
	rand.Read(body)
	release := make(chan struct{})
	// A command timeout above the shipped 250 ms: the test asserts that
	// the leader's finish reached Redis, which on a CI machine loaded by
	// other packages' tests can take its step longer than that to send.
	f := newPeerFleet(t, 3, Config{MaxValueBytes: 64 << 10, Timeout: time.Second}, dedup.Config{}, heldBody(body, 512<<10, release))
	t.Cleanup(func() { closeOnce(release) }) // before the engines close
	a, b, c := f.insts[0], f.insts[1], f.insts[2]
	leader, err := a.openAt(f.origin.URL + "/big")
	if err != nil {
		t.Fatal(err)
	}
	defer leader.Body.Close()

	type got struct {
		xcache string
		body   []byte
		err    error
	}
	results := make(chan got, 32)
	started := 0
	client := func(in *instance) {
		started++
		resp, err := in.openAt(f.origin.URL + "/big")
		if err != nil {
			results <- got{err: err}
			return
		}
		go func() {
			defer resp.Body.Close()
			all, err := io.ReadAll(resp.Body)
			results <- got{resp.Header.Get(dedup.HeaderCache), all, err}
		}()
	}
	// Clients on B and C, then more once their first responses are in
	// (the download is still held): both read from A.
	for range 4 {
		client(b)
		client(c)
	}
	for range 3 {
		client(b)
		client(c)
	}
	closeOnce(release)
	if all, err := io.ReadAll(leader.Body); err != nil || !bytes.Equal(all, body) {
		t.Fatalf("leader: %d bytes, %v", len(all), err)
	}
	for range started {
		g := <-results
		if g.err != nil || g.xcache != dedup.CacheCoalesced || !bytes.Equal(g.body, body) {
			t.Fatalf("client: %s, %d bytes, %v", g.xcache, len(g.body), g.err)
		}
	}
	if f.hits.Load() != 1 {
		t.Fatalf("origin saw %d requests, want 1", f.hits.Load())
	}
	for _, in := range []*instance{b, c} {
		if st := in.engine.Stats().PeerFetches; st != (dedup.PeerStats{OK: 1}) {
			t.Fatalf("%s peer fetches %+v, want one ok", in.name, st)
		}
	}
	key := leader.Header.Get(dedup.HeaderCacheKey)
	ctx := context.Background()
	for _, k := range []string{a.store.valueKey(tagOf(key)), a.store.lockKey(tagOf(key))} {
		if n, _ := f.redis.Client().Exists(ctx, k).Result(); n != 0 {
			t.Errorf("%s still in Redis", k)
		}
	}
	// Each follower answers from its own copy now.
	for _, in := range []*instance{b, c} {
		testkit.Eventually(t, testkit.Patience, func() bool { return in.engine.Stats().Flights == 0 }, "%s's download to end", in.name)
		if g := in.get(f.origin.URL + "/big"); g.xcache != dedup.CacheHit || g.body != string(body) {
			t.Fatalf("%s again: %s", in.name, g.xcache)
		}
	}
	if f.hits.Load() != 1 {
		t.Fatalf("origin saw %d requests, want 1", f.hits.Load())
	}
}

// TestPeerLeaderGoneMidBody: the leader instance vanishes in the middle
// of the download (its Redis connections and its peer connections die):
// the followers' clients, which had part of the body, get all of it,
// finished from the origin by their instance, once per instance.
func TestPeerLeaderGoneMidBody(t *testing.T) {
	body := make([]byte, 2<<20)
	rand.Read(body)
	release := make(chan struct{})
	f := newPeerFleet(t, 3, Config{MaxValueBytes: 64 << 10}, dedup.Config{}, heldBody(body, 512<<10, release))
	t.Cleanup(func() { closeOnce(release) })
	a := f.insts[0]
	leader, err := a.openAt(f.origin.URL + "/big")
	if err != nil {
		t.Fatal(err)
	}
	defer leader.Body.Close()
	const per = 3
	results := make(chan error, 2*per)
	heads := make(chan struct{}, 2*per)
	for _, in := range f.insts[1:] {
		for range per {
			go func() {
				resp, err := in.openAt(f.origin.URL + "/big")
				if err != nil {
					heads <- struct{}{}
					results <- err
					return
				}
				defer resp.Body.Close()
				head := make([]byte, 256<<10)
				_, err = io.ReadFull(resp.Body, head)
				heads <- struct{}{}
				rest, err2 := io.ReadAll(resp.Body)
				if err == nil {
					err = err2
				}
				if err == nil && !bytes.Equal(append(head, rest...), body) {
					err = fmt.Errorf("%d bytes, not the body", len(head)+len(rest))
				}
				results <- err
			}()
		}
	}
	for range 2 * per {
		<-heads
	}
	a.store.rdb.Close()
	a.peer.Server.CloseClientConnections()
	for range 2 * per {
		if err := <-results; err != nil {
			t.Fatalf("follower's client: %v", err)
		}
	}
	if f.hits.Load() != 3 {
		t.Fatalf("origin saw %d requests, want 3 (the leader's, one per follower)", f.hits.Load())
	}
	for _, in := range f.insts[1:] {
		if st := in.engine.Stats().PeerFetches; st != (dedup.PeerStats{Fallback: 1}) {
			t.Fatalf("%s peer fetches %+v, want one fallback", in.name, st)
		}
	}
}

// TestStreamingLeaderAndInstancesWithoutPeers: an instance without a peer
// listener (an older version, or one configured without) waiting on a
// leader that streams gets the outcome it knows, "fetch your own", and
// does; the instance with peers reads from the leader.
func TestStreamingLeaderAndInstancesWithoutPeers(t *testing.T) {
	body := make([]byte, 1<<20)
	rand.Read(body)
	release := make(chan struct{})
	f := newPeerFleet(t, 2, Config{MaxValueBytes: 64 << 10}, dedup.Config{}, heldBody(body, 256<<10, release))
	f.peers = false
	old := f.start("old", Config{MaxValueBytes: 64 << 10}, dedup.Config{})
	t.Cleanup(func() { closeOnce(release) })
	leader, err := f.insts[0].openAt(f.origin.URL + "/big")
	if err != nil {
		t.Fatal(err)
	}
	defer leader.Body.Close()
	var resps []*http.Response
	for _, in := range []*instance{f.insts[1], old} {
		resp, err := in.openAt(f.origin.URL + "/big")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		resps = append(resps, resp)
	}
	closeOnce(release)
	io.Copy(io.Discard, leader.Body)
	for _, resp := range resps {
		if all, err := io.ReadAll(resp.Body); err != nil || !bytes.Equal(all, body) {
			t.Fatalf("%d bytes, %v", len(all), err)
		}
	}
	if x := resps[1].Header.Get(dedup.HeaderCache); x != dedup.CacheBypass {
		t.Fatalf("the instance without peers answered %s, want its own fetch (BYPASS)", x)
	}
	if f.hits.Load() != 2 {
		t.Fatalf("origin saw %d requests, want 2 (the leader's, the instance without peers')", f.hits.Load())
	}
	if st := f.insts[1].engine.Stats().PeerFetches; st.OK != 1 {
		t.Fatalf("peer fetches %+v", st)
	}
}

// TestLeaseTokenNamesThePeer: a lease's token names the peer listener in a
// shape older versions read as before: the holder's instance for a
// token minted with a presence key, none for one without (an address has
// dots, which an older version would have taken for the presence mark).
func TestLeaseTokenNamesThePeer(t *testing.T) {
	c := &Cache{client: &client{instance: "0123456789ab"}}
	other := &Cache{client: &client{instance: "ba9876543210"}}
	c.AdvertisePeer("10.1.2.3:7070")
	for _, present := range []bool{true, false} {
		if present {
			c.presentUntil.Store(time.Now().Add(time.Hour).UnixNano())
		} else {
			c.presentUntil.Store(0)
		}
		tok := c.leaseToken()
		inst, ok := holderOf(tok)
		if ok != present || (present && inst != "0123456789ab") {
			t.Fatalf("token %q: holderOf = %q, %v (presence %v)", tok, inst, ok, present)
		}
		p := other.peerOf(tok)
		if p == nil || p.Addr != "10.1.2.3:7070" || p.Instance != "0123456789ab" {
			t.Fatalf("token %q names %+v", tok, p)
		}
		if c.peerOf(tok) != nil {
			t.Fatalf("an instance is its own peer: %q", tok)
		}
	}
	for _, tok := range []string{"", "0123.5", "0123.5~", "0123.5~!!", "0123.5~" + "MTI3LjAuMC4x", ".5~MTI3LjAuMC4xOjgw"} {
		if p := other.peerOf(tok); p != nil {
			t.Errorf("%q names a peer: %+v", tok, p)
		}
	}
}

func closeOnce(ch chan struct{}) {
	select {
	case <-ch:
	default:
		close(ch)
	}
}
