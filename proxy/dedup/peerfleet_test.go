package dedup

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
	"github.com/seed-a3c387e8/onceproxy/internal/logbuf"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// streamFleet is a Fleet for engines in one test process whose leases can
// stream: the first Join of a key leads; later ones wait until its lease
// streams (TooLarge naming the leader's peer listener, as long as the
// lease is held) or finishes. It stands in for a shared store at the seam;
// rediscache and pgstore run the same engines on the real stores.
type streamFleet struct {
	above   int64 // StreamAbove of every lease
	mu      sync.Mutex
	flights map[string]*sfFlight
}

type sfFlight struct {
	streamed chan struct{} // closed by Stream
	done     chan struct{} // closed by Finish or Release
	peer     Peer
	out      Outcome
}

// member is the Fleet of one instance, whose leases name addr.
func (f *streamFleet) member(instance, addr string) Fleet {
	return sfMember{f: f, peer: Peer{Instance: instance, Addr: addr}}
}

type sfMember struct {
	f    *streamFleet
	peer Peer
}

func (m sfMember) Join(ctx context.Context, key string) (Lease, *Outcome, error) {
	m.f.mu.Lock()
	fl := m.f.flights[key]
	if fl == nil {
		fl = &sfFlight{streamed: make(chan struct{}), done: make(chan struct{})}
		m.f.flights[key] = fl
		m.f.mu.Unlock()
		return &sfLease{m: m, key: key, fl: fl}, nil, nil
	}
	m.f.mu.Unlock()
	select {
	case <-fl.streamed:
		out := TooLarge(&fl.peer)
		return nil, &out, nil
	case <-fl.done:
		out := fl.out
		return nil, &out, nil
	case <-ctx.Done():
		return nil, nil, ctx.Err()
	}
}

type sfLease struct {
	m    sfMember
	key  string
	fl   *sfFlight
	once sync.Once
}

func (l *sfLease) StreamAbove() int64 { return l.m.f.above }

func (l *sfLease) Stream(context.Context) error {
	l.fl.peer = l.m.peer
	close(l.fl.streamed)
	return nil
}

func (l *sfLease) Finish(_ context.Context, out Outcome, _ time.Duration) error {
	l.once.Do(func() { l.end(out) })
	return nil
}

func (l *sfLease) Release() { l.once.Do(func() { l.end(Outcome{Err: "released"}) }) }

func (l *sfLease) end(out Outcome) {
	l.m.f.mu.Lock()
	delete(l.m.f.flights, l.key)
	l.m.f.mu.Unlock()
	l.fl.out = out
	select {
	case <-l.fl.streamed:
		// Its waiters were sent to the peer; the flight is over.
		l.fl.out = TooLarge(nil)
	default:
	}
	close(l.fl.done)
}

// peerInstance is one engine of a streaming fleet with its peer listener.
type peerInstance struct {
	eng   *Engine
	up    *countingTransport
	peer  *httptest.Server
	logs  *logbuf.Buffer
	store *MemoryStore
}

// peerFleet starts n engines in front of origin sharing one streamFleet;
// wrap, when set, wraps each peer listener's handler (the listener's own
// authentication, in the program).
func peerFleet(t testing.TB, n int, origin *httptest.Server, cfg Config, wrap func(http.Handler) http.Handler) []*peerInstance {
	t.Helper()
	fleet := &streamFleet{above: 64 << 10, flights: map[string]*sfFlight{}}
	var out []*peerInstance
	for i := range n {
		in := &peerInstance{logs: &logbuf.Buffer{}}
		var h http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { in.eng.PeerHandler().ServeHTTP(w, r) })
		if wrap != nil {
			h = wrap(h)
		}
		in.peer = httptest.NewServer(h)
		t.Cleanup(in.peer.Close)
		tr := &http.Transport{DisableCompression: true}
		t.Cleanup(tr.CloseIdleConnections)
		in.up = &countingTransport{rt: tr}
		c := streamConfig(t, cfg)
		c.Enabled = true
		c = c.WithDefaults()
		in.store = NewMemoryStore(int64(c.Memory.MaxBytes))
		t.Cleanup(in.store.Close)
		pc := NewPeerClient(PeerClientConfig{Timeout: 5 * time.Second})
		t.Cleanup(pc.Close)
		eng, err := New(c, Options{Store: in.store, Next: in.up, Peers: pc, Fleet: fleet.member(strconv.Itoa(i), in.peer.Listener.Addr().String()),
			Logger: slog.New(slog.NewTextHandler(in.logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		in.eng = eng
		t.Cleanup(eng.Close)
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("instance %d:\n%s", i, in.logs)
			}
		})
		out = append(out, in)
	}
	return out
}

func (in *peerInstance) open(ctx context.Context, url string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	return in.eng.RoundTrip(req)
}

// heldOrigin serves body with its length, the first held bytes at once
// and the rest once release is closed (for the first request only: later
// ones get it all at once). hits counts its requests.
func heldOrigin(t *testing.T, body []byte, held int, release <-chan struct{}, hits *atomic.Int64) *httptest.Server {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := hits.Add(1)
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.Header().Set("Content-Type", "application/octet-stream")
		if n > 1 {
			writeSlowly(w, body)
			return
		}
		writeSlowly(w, body[:held])
		<-release
		writeSlowly(w, body[held:])
	}))
	t.Cleanup(origin.Close)
	return origin
}

// TestFollowersReadTheLeadersDownload: a body too big for the shared store
// is downloaded once for two instances. The other instance's clients get
// their headers and first bytes while the origin still holds the rest
// (streamed from the leader's peer listener into their own flight), every
// client gets the whole body byte for byte, and the follower caches its
// copy: its next client is a HIT, with still one origin download.
func TestFollowersReadTheLeadersDownload(t *testing.T) {
	body := pattern(3 << 20)
	release := make(chan struct{})
	var hits atomic.Int64
	origin := heldOrigin(t, body, 256<<10, release, &hits)
	insts := peerFleet(t, 2, origin, Config{MaxBodyBytes: 1 * bytesize.MiB}, nil)
	// Before the engines close, which waits for their downloads.
	t.Cleanup(func() { closeOnce(release) })
	a, b := insts[0], insts[1]

	leader, err := a.open(context.Background(), origin.URL+"/big")
	if err != nil {
		t.Fatal(err)
	}
	defer leader.Body.Close()
	const n = 6
	type got struct {
		xcache string
		body   []byte
		err    error
	}
	results := make(chan got, n)
	firstBytes := make(chan struct{}, n)
	for i := range n {
		in := insts[i%2]
		go func() {
			resp, err := in.open(context.Background(), origin.URL+"/big")
			if err != nil {
				results <- got{err: err}
				firstBytes <- struct{}{}
				return
			}
			defer resp.Body.Close()
			head := make([]byte, 128<<10)
			_, err = io.ReadFull(resp.Body, head)
			firstBytes <- struct{}{}
			rest, err2 := io.ReadAll(resp.Body)
			results <- got{resp.Header.Get(HeaderCache), append(head, rest...), firstErr(err, err2)}
		}()
	}
	for range n {
		select {
		case <-firstBytes:
		case <-time.After(testkit.Patience):
			t.Fatal("clients got no first bytes while the origin held the rest")
		}
	}
	closeOnce(release)
	if all, err := io.ReadAll(leader.Body); err != nil || !bytes.Equal(all, body) || leader.Header.Get(HeaderCache) != CacheMiss {
		t.Fatalf("leader: %s, %d bytes, %v", leader.Header.Get(HeaderCache), len(all), err)
	}
	for range n {
		g := <-results
		if g.err != nil || !bytes.Equal(g.body, body) || g.xcache != CacheCoalesced {
			t.Fatalf("client: %s, %d bytes, %v", g.xcache, len(g.body), g.err)
		}
	}
	if hits.Load() != 1 {
		t.Fatalf("origin saw %d requests, want 1", hits.Load())
	}
	if st := b.eng.Stats().PeerFetches; st != (PeerStats{OK: 1}) {
		t.Fatalf("follower's peer fetches %+v, want one ok", st)
	}
	if st := a.eng.Stats(); st.XCache[CacheCoalesced] != n/2 || st.Requests != n/2+1 {
		t.Fatalf("leader counted %v: the follower's read is not a client's", st.XCache)
	}
	testkit.Eventually(t, testkit.Patience, func() bool { return b.eng.flights.running() == 0 }, "the follower's flight to end")
	resp, err := b.open(context.Background(), origin.URL+"/big")
	if err != nil {
		t.Fatal(err)
	}
	again, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || !bytes.Equal(again, body) || resp.Header.Get(HeaderCache) != CacheHit {
		t.Fatalf("follower again: %s, %d bytes, %v", resp.Header.Get(HeaderCache), len(again), err)
	}
	if hits.Load() != 1 {
		t.Fatalf("origin saw %d requests after the follower's HIT, want 1", hits.Load())
	}
}

// TestPeerFallback: a follower whose peer cannot serve the body (nothing
// listens, the token is refused, it holds nothing under the key) fetches
// it from the origin for all its clients at once: one more download,
// every body complete, and the fallback counted.
func TestPeerFallback(t *testing.T) {
	for _, tc := range []struct {
		name string
		wrap func(http.Handler) http.Handler
		dead bool
	}{
		{name: "refused", dead: true},
		{name: "bad token", wrap: func(http.Handler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { http.Error(w, "token", http.StatusUnauthorized) })
		}},
		{name: "nothing held", wrap: func(http.Handler) http.Handler { return http.NotFoundHandler() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := pattern(1 << 20)
			release := make(chan struct{})
			var hits atomic.Int64
			origin := heldOrigin(t, body, 128<<10, release, &hits)
			insts := peerFleet(t, 2, origin, Config{MaxBodyBytes: 256 * bytesize.KiB}, tc.wrap)
			// Before the engines close, which waits for their downloads.
			t.Cleanup(func() { closeOnce(release) })
			a, b := insts[0], insts[1]
			if tc.dead {
				insts[0].peer.Close()
			}
			leader, err := a.open(context.Background(), origin.URL+"/big")
			if err != nil {
				t.Fatal(err)
			}
			defer leader.Body.Close()
			const n = 4
			errs := make(chan error, n)
			for range n {
				go func() {
					resp, err := b.open(context.Background(), origin.URL+"/big")
					if err != nil {
						errs <- err
						return
					}
					got, err := io.ReadAll(resp.Body)
					resp.Body.Close()
					if err == nil && !bytes.Equal(got, body) {
						err = io.ErrUnexpectedEOF
					}
					errs <- err
				}()
			}
			for range n {
				if err := <-errs; err != nil {
					t.Fatalf("follower's client: %v", err)
				}
			}
			expectOwnCopy(t, release, leader, body, &hits, b)
		})
	}
}

// TestPeerCutMidBody: the peer's response is cut after the follower's
// clients had part of the body. The follower finishes it from the origin:
// the rest by Range when the response has a strong ETag, else the whole
// body again, checked against the bytes the clients already have. If the
// origin now sends other bytes, the clients get an error, never a short
// or spliced 200.
func TestPeerCutMidBody(t *testing.T) {
	for _, tc := range []struct {
		name      string
		etag      bool
		changed   bool
		wantRange bool
	}{
		{name: "range with etag", etag: true, wantRange: true},
		{name: "whole body checked", etag: false},
		{name: "body changed", changed: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := pattern(2 << 20)
			other := bytes.Clone(body)
			other[100] ^= 0xff // inside the part the clients already have
			release := make(chan struct{})
			var hits atomic.Int64
			var ranged atomic.Bool
			origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				n := hits.Add(1)
				w.Header().Set("Content-Type", "application/octet-stream")
				if tc.etag {
					w.Header().Set("ETag", `"v1"`)
				}
				if n > 1 {
					if r.Header.Get("Range") != "" {
						ranged.Store(true)
					}
					b := body
					if tc.changed {
						b = other
					}
					http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(b))
					return
				}
				w.Header().Set("Content-Length", strconv.Itoa(len(body)))
				writeSlowly(w, body[:512<<10])
				<-release
				writeSlowly(w, body[512<<10:])
			}))
			t.Cleanup(origin.Close)
			insts := peerFleet(t, 2, origin, Config{MaxBodyBytes: 256 * bytesize.KiB}, nil)
			// Before the engines close, which waits for their downloads.
			t.Cleanup(func() { closeOnce(release) })
			a, b := insts[0], insts[1]
			leader, err := a.open(context.Background(), origin.URL+"/big")
			if err != nil {
				t.Fatal(err)
			}
			defer leader.Body.Close()
			resp, err := b.open(context.Background(), origin.URL+"/big")
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			head := make([]byte, 256<<10)
			if _, err := io.ReadFull(resp.Body, head); err != nil || !bytes.Equal(head, body[:len(head)]) {
				t.Fatalf("follower's first bytes: %v", err)
			}
			// The leader instance goes away as far as the follower can
			// tell; its own download goes on.
			a.peer.CloseClientConnections()
			rest, err := io.ReadAll(resp.Body)
			got := append(head, rest...)
			if tc.changed {
				if err == nil {
					t.Fatalf("a body that changed reached the client whole-looking: %d bytes", len(got))
				}
				if !bytes.Equal(got, body[:len(got)]) {
					t.Fatal("the client got bytes of two versions")
				}
			} else if err != nil || !bytes.Equal(got, body) {
				t.Fatalf("follower's client: %d bytes, %v", len(got), err)
			}
			if ranged.Load() != tc.wantRange {
				t.Fatalf("resumed with a Range: %v, want %v", ranged.Load(), tc.wantRange)
			}
			if st := b.eng.Stats().PeerFetches; st != (PeerStats{Fallback: 1}) {
				t.Fatalf("follower's peer fetches %+v, want one fallback", st)
			}
			closeOnce(release)
			if all, err := io.ReadAll(leader.Body); err != nil || !bytes.Equal(all, body) {
				t.Fatalf("leader: %d bytes, %v", len(all), err)
			}
			if hits.Load() != 2 {
				t.Fatalf("origin saw %d requests, want 2", hits.Load())
			}
		})
	}
}

// TestPeerVariantStaysItsOwn: the leader's body varies on User-Agent; a
// follower whose client sends another one, joining while the leader
// streams, does not answer it with the leader's variant from the peer but
// fetches its own.
func TestPeerVariantStaysItsOwn(t *testing.T) {
	var hits atomic.Int64
	release := make(chan struct{})
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := hits.Add(1)
		b := bytes.Repeat([]byte(r.Header.Get("User-Agent")), 100<<10)
		w.Header().Set("Vary", "User-Agent")
		w.Header().Set("Content-Length", strconv.Itoa(len(b)))
		writeSlowly(w, b[:64<<10])
		if n == 1 {
			<-release
		}
		writeSlowly(w, b[64<<10:])
	}))
	t.Cleanup(origin.Close)
	insts := peerFleet(t, 2, origin, Config{MaxBodyBytes: 128 * bytesize.KiB}, nil)
	// Before the engines close, which waits for their downloads.
	t.Cleanup(func() { closeOnce(release) })
	open := func(in *peerInstance, ua string) *http.Response {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, origin.URL+"/v", nil)
		req.Header.Set("User-Agent", ua)
		resp, err := in.eng.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { resp.Body.Close() })
		return resp
	}
	read := func(resp *http.Response) string {
		t.Helper()
		b, err := io.ReadAll(resp.Body)
		if err != nil || len(b) != 300<<10 {
			t.Fatalf("%d bytes, %v", len(b), err)
		}
		return string(b[:3])
	}
	leader := open(insts[0], "aaa")
	if b := read(open(insts[1], "bbb")); b != "bbb" {
		t.Fatalf("the follower's client with another User-Agent got %q", b)
	}
	closeOnce(release)
	if b := read(leader); b != "aaa" {
		t.Fatalf("leader got %q", b)
	}
	if hits.Load() != 2 {
		t.Fatalf("origin saw %d requests, want one per variant", hits.Load())
	}
}

// expectOwnCopy releases the held origin and checks that the leader got
// the whole body and that follower b fell back to a copy of its own: two
// origin requests, one peer fallback.
func expectOwnCopy(t *testing.T, release chan struct{}, leader *http.Response, body []byte, hits *atomic.Int64, b *peerInstance) {
	t.Helper()
	closeOnce(release)
	if all, err := io.ReadAll(leader.Body); err != nil || !bytes.Equal(all, body) {
		t.Fatalf("leader: %d bytes, %v", len(all), err)
	}
	if hits.Load() != 2 {
		t.Fatalf("origin saw %d requests, want 2 (the leader's, the follower's own)", hits.Load())
	}
	if st := b.eng.Stats().PeerFetches; st != (PeerStats{Fallback: 1}) {
		t.Fatalf("follower's peer fetches %+v, want one fallback", st)
	}
}

func closeOnce(ch chan struct{}) {
	select {
	case <-ch:
	default:
		close(ch)
	}
}

func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
