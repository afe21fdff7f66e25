package upstream_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/capture"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/fporigin"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// A client is how a test's requests reach the pool: as requests of an
// intercepted client, whose fingerprint and header order ride in the
// context as the proxy's MITM puts them there (fp set: the pool mirrors
// them, its default), or as requests without one (the /fetch API, health
// probes: net/http's transports).
type client struct {
	name string
	fp   *fingerprint.Fingerprint
}

// bothWays runs f as a client without a fingerprint and as a mirrored one.
func bothWays(t *testing.T, f func(t *testing.T, c client)) {
	for _, c := range []client{{name: "net/http"}, {name: "mirrored", fp: goFingerprint(t, "h2", "http/1.1")}} {
		t.Run(c.name, func(t *testing.T) { f(t, c) })
	}
}

// goFingerprint is the fingerprint of an HTTP/1.1 connection of Go's TLS
// client offering protos, as the proxy's capture reads it.
func goFingerprint(t testing.TB, protos ...string) *fingerprint.Fingerprint {
	return fingerprint.New(helloOf(t, &tls.Config{ServerName: "localhost", NextProtos: protos}), nil)
}

// helloOf captures the ClientHello crypto/tls sends with cfg.
func helloOf(t testing.TB, cfg *tls.Config) *fingerprint.ClientHello {
	t.Helper()
	cli, srv := net.Pipe()
	go func() {
		tls.Client(cli, cfg).Handshake() // fails once srv closes: only the hello matters
		cli.Close()
	}()
	_, h, err := capture.PeekClientHello(srv)
	srv.Close()
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// request gives req the client's fingerprint and a shape: the header
// order a client would have sent (Host first, then the fields sorted).
func (c client) request(req *http.Request) *http.Request {
	if c.fp == nil {
		return req
	}
	order := []string{"Host"}
	for k := range req.Header {
		order = append(order, k)
	}
	slices.Sort(order[1:])
	ctx := fingerprint.WithShape(fingerprint.WithFingerprint(req.Context(), c.fp), &fingerprint.Shape{HeaderOrder: order})
	return req.WithContext(ctx)
}

func (c client) send(t *testing.T, rt http.RoundTripper, method, u string, info clientinfo.Info, body string) (result, error) {
	t.Helper()
	return sendAs(t, c, rt, method, u, info, body)
}

func (c client) mustGet(t *testing.T, rt http.RoundTripper, u string, info clientinfo.Info) result {
	t.Helper()
	r, err := c.send(t, rt, http.MethodGet, u, info, "")
	if err != nil {
		t.Fatalf("GET %s: %v", u, err)
	}
	return r
}

func (c client) get(t *testing.T, rt http.RoundTripper, u string) (*http.Response, string, error) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, u, nil)
	resp, err := rt.RoundTrip(c.request(req))
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp, string(b), err
}

// mirrored checks that a mirrored client's TLS requests really went out
// with its hello, and a client without one with Go's.
func (c client) mirrored(t *testing.T, p *upstream.Pool) {
	t.Helper()
	n := p.HelloCounts()
	if c.fp != nil && n["mirrored"] == 0 || c.fp == nil && n["mirrored"] != 0 {
		t.Errorf("%s client: upstream connections by hello %v", c.name, n)
	}
}

// TestMirroredRetriesAConnectionTheOriginClosed: an origin that closes each
// connection after its response (without saying so) leaves a dead
// connection in the pool; the next request finds it dead before any answer
// and goes again on a new one, as under net/http.
func TestMirroredRetriesAConnectionTheOriginClosed(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var conns atomic.Int32
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Add(1)
			go func() {
				defer c.Close()
				if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
					return
				}
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			}()
		}
	}()
	c := client{name: "mirrored", fp: goFingerprint(t, "http/1.1")}
	p := newPool(t, upstream.Config{}, quiet)
	u := "http://" + ln.Addr().String() + "/"
	for i := range 3 {
		if r := c.mustGet(t, p, u, clientinfo.Info{}); r.status != 200 || r.body != "ok" {
			t.Fatalf("request %d: %+v", i, r)
		}
		testkit.Eventually(t, testkit.Patience, func() bool { return conns.Load() == int32(i+1) }, "a connection per request")
	}
}

// TestMirroredResponseHeaderTimeout: response_header_timeout bounds the wait
// for a mirrored request's answer, and the error says it is a timeout.
// Over HTTP/1.1 a read deadline bounds it, over HTTP/2 a timer; after the
// timeout the pool still serves.
func TestMirroredResponseHeaderTimeout(t *testing.T) {
	for _, h2 := range []bool{false, true} {
		t.Run(map[bool]string{false: "h1", true: "h2"}[h2], func(t *testing.T) {
			release := make(chan struct{})
			defer close(release)
			origin := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/slow" {
					select {
					case <-release:
					case <-r.Context().Done():
					}
				}
				w.Header().Set("X-Proto", r.Proto)
			}))
			origin.EnableHTTP2 = h2
			origin.StartTLS()
			defer origin.Close()
			c := client{name: "mirrored", fp: goFingerprint(t, "h2", "http/1.1")}
			p := newPool(t, upstream.Config{ResponseHeaderTimeout: 200 * time.Millisecond, CAFiles: []string{originCAFile(t, origin)}}, quiet)
			start := time.Now()
			_, _, err := c.get(t, p, origin.URL+"/slow")
			var ne net.Error
			if !errors.As(err, &ne) || !ne.Timeout() || !strings.Contains(err.Error(), "response headers") {
				t.Fatalf("err = %v, want a response header timeout", err)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("gave up after %v", d)
			}
			resp, _, err := c.get(t, p, origin.URL+"/fast")
			if err != nil {
				t.Fatalf("after the timeout: %v", err)
			}
			if want := map[bool]string{false: "HTTP/1.1", true: "HTTP/2.0"}[h2]; resp.Header.Get("X-Proto") != want {
				t.Errorf("origin saw %q, want %q", resp.Header.Get("X-Proto"), want)
			}
			c.mirrored(t, p)
		})
	}
}

// slowBody is a request body of n KiB, each after gap.
type slowBody struct {
	n   int
	gap time.Duration
}

func (b *slowBody) Read(p []byte) (int, error) {
	if b.n == 0 {
		return 0, io.EOF
	}
	time.Sleep(b.gap)
	b.n--
	k := min(len(p), 1024)
	for i := range k {
		p[i] = 'x'
	}
	return k, nil
}

// TestResponseHeaderTimeoutStartsAfterTheUpload: response_header_timeout
// counts from the end of the request's body, as net/http's does. An
// upload slower than the timeout is answered, where it used to fail with
// a header timeout (and, over HTTP/2, cost the connection); an origin
// that reads the whole body, then answers nothing, still times out.
func TestResponseHeaderTimeoutStartsAfterTheUpload(t *testing.T) {
	const timeout = 300 * time.Millisecond
	for _, h2 := range []bool{false, true} {
		t.Run(map[bool]string{false: "h1", true: "h2"}[h2], func(t *testing.T) {
			release := make(chan struct{})
			defer close(release)
			origin := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				n, _ := io.Copy(io.Discard, r.Body)
				if r.URL.Path == "/silent" {
					select {
					case <-release:
					case <-r.Context().Done():
					}
				}
				fmt.Fprint(w, n)
			}))
			origin.EnableHTTP2 = h2
			origin.StartTLS()
			defer origin.Close()
			c := client{name: "mirrored", fp: goFingerprint(t, "h2", "http/1.1")}
			p := newPool(t, upstream.Config{ResponseHeaderTimeout: timeout, CAFiles: []string{originCAFile(t, origin)}}, quiet)
			upload := func(path string) (string, error) {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, origin.URL+path, &slowBody{n: 8, gap: timeout / 4})
				req.ContentLength = 8 << 10
				req.Header.Set("Content-Type", "application/octet-stream")
				resp, err := p.RoundTrip(c.request(req))
				if err != nil {
					return "", err
				}
				defer resp.Body.Close()
				b, err := io.ReadAll(resp.Body)
				return string(b), err
			}
			// 8 KiB over 2 s, against a timeout of 300 ms.
			if got, err := upload("/upload"); err != nil || got != "8192" {
				t.Fatalf("a slow upload: %q, %v; want the origin's count, 8192", got, err)
			}
			_, err := upload("/silent")
			var ne net.Error
			if !errors.As(err, &ne) || !ne.Timeout() || !strings.Contains(err.Error(), "response headers") {
				t.Fatalf("an upload the origin read and left unanswered: %v; want a response header timeout", err)
			}
			c.mirrored(t, p)
		})
	}
}

// TestMirroredPoolBounds: idle connections beyond max_idle_conns_per_host
// close when their request is done, the ones kept serve the next requests,
// and idle_conn_timeout closes them in the end.
func TestMirroredPoolBounds(t *testing.T) {
	const parallel = 3
	arrived := make(chan struct{}, parallel)
	gate := make(chan struct{})
	origin, err := fporigin.Start(fporigin.Options{NextProtos: []string{"http/1.1"}, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/parallel") {
			arrived <- struct{}{}
			<-gate
		}
		io.WriteString(w, "ok")
	})})
	if err != nil {
		t.Fatal(err)
	}
	defer origin.Close()
	c := client{name: "mirrored", fp: goFingerprint(t, "http/1.1")}
	p := newPool(t, upstream.Config{MaxIdleConnsPerHost: 1, IdleConnTimeout: 300 * time.Millisecond, CAFiles: []string{origin.CAFile()}}, quiet)
	var wg sync.WaitGroup
	for i := range parallel {
		wg.Go(func() { c.mustGet(t, p, fmt.Sprintf("%s/parallel-%d", origin.URL(), i), clientinfo.Info{}) })
	}
	for range parallel {
		<-arrived
	}
	close(gate)
	wg.Wait()
	connOf := func(path string) int {
		for _, r := range origin.Records() {
			if r.Path == path {
				return r.Conn
			}
		}
		t.Fatalf("no record of %s", path)
		return 0
	}
	seen := map[int]bool{}
	for i := range parallel {
		seen[connOf(fmt.Sprintf("/parallel-%d", i))] = true
	}
	if len(seen) != parallel {
		t.Fatalf("%d parallel HTTP/1.1 requests came on %d connections", parallel, len(seen))
	}
	// One connection was kept: three requests in a row reuse it.
	var kept int
	for i := range 3 {
		path := fmt.Sprintf("/next-%d", i)
		c.mustGet(t, p, origin.URL()+path, clientinfo.Info{})
		conn := connOf(path)
		if !seen[conn] || kept != 0 && conn != kept {
			t.Fatalf("%s came on connection %d (the parallel ones: %v, kept %d)", path, conn, seen, kept)
		}
		kept = conn
	}
	// Left idle past idle_conn_timeout, it is closed: the next request
	// opens a new connection.
	n := 0
	testkit.Eventually(t, testkit.Patience, func() bool {
		time.Sleep(400 * time.Millisecond)
		path := fmt.Sprintf("/later-%d", n)
		n++
		c.mustGet(t, p, origin.URL()+path, clientinfo.Info{})
		return connOf(path) != kept
	}, "a new connection after the idle timeout")
}

// TestTimedSessionRecyclesMirroredConnections: a timed session's mirrored
// connections are recycled at its rotation interval, so requests reach the
// new exit IP instead of riding a connection opened from the previous one.
func TestTimedSessionRecyclesMirroredConnections(t *testing.T) {
	var mu sync.Mutex
	now := time.Now()
	clock := func() time.Time {
		mu.Lock()
		defer mu.Unlock()
		return now
	}
	fp := fakeprovider.Start(t, fakeprovider.Options{Rotation: fakeprovider.Timed, Interval: time.Minute, Now: clock})
	o := newOrigin(t, true)
	cfg := providerConfig(fp)
	cfg.CAFiles = []string{originCAFile(t, o.Server)}
	p := newPool(t, cfg, quiet)
	upstream.SetClock(p, clock)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.Run(ctx)
	}()
	defer func() {
		cancel()
		<-done
	}()
	c := client{name: "mirrored", fp: goFingerprint(t, "http/1.1")}
	first := c.mustGet(t, p, o.URL, clientinfo.Info{}).body
	if again := c.mustGet(t, p, o.URL, clientinfo.Info{}).body; again != first || fp.Conns("s1") != 1 {
		t.Fatalf("within the interval: %s then %s over %d gateway connections, want one", first, again, fp.Conns("s1"))
	}
	testkit.Eventually(t, testkit.Patience, func() bool {
		mu.Lock()
		now = now.Add(61 * time.Second)
		mu.Unlock()
		time.Sleep(300 * time.Millisecond) // the recycle loop looks every second
		return c.mustGet(t, p, o.URL, clientinfo.Info{}).body != first
	}, "a request from the new exit IP")
	c.mirrored(t, p)
}

// TestRuleFingerprintGo: a rule's fingerprint: go sends its requests the
// net/http way, the rest are mirrored.
func TestRuleFingerprintGo(t *testing.T) {
	origin := httptest.NewTLSServer(http.HandlerFunc(echo))
	defer origin.Close()
	_, port, _ := net.SplitHostPort(origin.Listener.Addr().String())
	c := client{name: "mirrored", fp: goFingerprint(t, "h2", "http/1.1")}
	p := newPool(t, upstream.Config{CAFiles: []string{originCAFile(t, origin)},
		Rules: []upstream.RuleConfig{{Host: "example.com", Fingerprint: upstream.FingerprintGo}}}, quiet)
	// The httptest certificate names example.com and 127.0.0.1; both
	// reach it through the test lookup below.
	if _, _, err := c.get(t, p, "https://127.0.0.1:"+port+"/m"); err != nil {
		t.Fatal(err)
	}
	if n := p.HelloCounts(); n["mirrored"] != 1 || n["go"] != 0 {
		t.Fatalf("after a request outside the rule: %v", n)
	}
	lookup := upstream.WithLookup(func(ctx context.Context, network, host string) ([]netip.Addr, error) {
		return []netip.Addr{netip.MustParseAddr("127.0.0.1")}, nil
	})
	p2, err := upstream.New(upstream.Config{CAFiles: []string{originCAFile(t, origin)},
		Rules: []upstream.RuleConfig{{Host: "example.com", Fingerprint: upstream.FingerprintGo}}}, quiet, lookup)
	if err != nil {
		t.Fatal(err)
	}
	defer p2.Close()
	if _, _, err := c.get(t, p2, "https://example.com:"+port+"/g"); err != nil {
		t.Fatal(err)
	}
	if n := p2.HelloCounts(); n["mirrored"] != 0 || n["go"] != 1 {
		t.Fatalf("after a request under the rule: %v", n)
	}
}

// TestPoolKeepsWhatABurstOpened: with the shipped pool limits, the
// connections 100 requests held at once on one origin opened all stay
// pooled, and the next 100 at once ride them instead of handshaking again
// (32 per origin, the default before, closed 68 and opened them anew).
func TestPoolKeepsWhatABurstOpened(t *testing.T) {
	bothWays(t, func(t *testing.T, c client) {
		const burst = 100
		arrived := make(chan struct{}, 2*burst) // room for a failed request's signal too
		var gate atomic.Pointer[chan struct{}]
		origin, err := fporigin.Start(fporigin.Options{NextProtos: []string{"http/1.1"}, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			g := *gate.Load()
			arrived <- struct{}{}
			<-g
			io.WriteString(w, "ok")
		})})
		if err != nil {
			t.Fatal(err)
		}
		defer origin.Close()
		p := newPool(t, upstream.Config{CAFiles: []string{origin.CAFile()}}, quiet)
		conns := func(round int) map[int]bool {
			g := make(chan struct{})
			gate.Store(&g)
			var wg sync.WaitGroup
			for i := range burst {
				wg.Go(func() {
					u := fmt.Sprintf("%s/%d/%d", origin.URL(), round, i)
					if _, err := c.send(t, p, http.MethodGet, u, clientinfo.Info{}, ""); err != nil {
						t.Errorf("GET %s: %v", u, err)
						arrived <- struct{}{} // failed, perhaps before arriving: do not wait for it
					}
				})
			}
			for range burst {
				<-arrived
			}
			close(g)
			wg.Wait()
			seen := map[int]bool{}
			prefix := fmt.Sprintf("/%d/", round)
			for _, r := range origin.Records() {
				if strings.HasPrefix(r.Path, prefix) {
					seen[r.Conn] = true
				}
			}
			return seen
		}
		first := conns(1)
		if len(first) != burst {
			t.Fatalf("%d requests held at once came on %d connections", burst, len(first))
		}
		var opened int
		for conn := range conns(2) {
			if !first[conn] {
				opened++
			}
		}
		// net/http puts a connection back in its pool just after the body
		// it carried was read, so a request of the next burst can find
		// one not back yet and take a fresh dial that wins: a few, not
		// the 68 a pool of 32 reopens.
		if opened > burst/10 {
			t.Errorf("the second burst opened %d new connections; the pool kept %d of the first's %d", opened, burst-opened, burst)
		}
	})
}
