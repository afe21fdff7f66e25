package proxy_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/fporigin"
	"github.com/seed-a3c387e8/onceproxy/internal/netguard"
	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// startFPOrigin starts a recording origin (package fporigin), stopped at
// the end of the test.
func startFPOrigin(t testing.TB, o fporigin.Options) *fporigin.Origin {
	t.Helper()
	origin, err := fporigin.Start(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { origin.Close() })
	return origin
}

// recordOf waits for the origin's record of the request for path.
func recordOf(t testing.TB, o *fporigin.Origin, path string) fporigin.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for n := 1; ; n++ {
		recs, err := o.Wait(ctx, n)
		for _, r := range recs {
			if r.Path == path {
				return r
			}
		}
		if err != nil {
			t.Fatalf("the origin never saw %s", path)
		}
	}
}

// hopByHop are the fields that end at a proxy (RFC 9110 §7.6.1): they may
// differ between a client's direct requests and its proxied ones.
var hopByHop = map[string]bool{
	"Connection": true, "Proxy-Connection": true, "Keep-Alive": true, "Te": true, "Trailer": true,
	"Transfer-Encoding": true, "Upgrade": true, "Proxy-Authorization": true,
}

func withoutHop(order []string) []string {
	var out []string
	for _, n := range order {
		if !hopByHop[http.CanonicalHeaderKey(n)] {
			out = append(out, n)
		}
	}
	return out
}

// sameFingerprint holds what the origin saw of a client through the proxy
// (got) to what it saw of the same client directly (want): JA4 and JA3,
// TLS version, ALPN, HTTP version, the HTTP/2 preface (Akamai), the SNI,
// and the header and pseudo-header orders, hop-by-hop fields aside.
func sameFingerprint(t *testing.T, want, got fporigin.Record) {
	t.Helper()
	if want.Hello == nil || got.Hello == nil {
		t.Fatalf("no hello recorded: direct %v, proxied %v", want.Hello != nil, got.Hello != nil)
	}
	check := func(what string, w, g any) {
		t.Helper()
		if fmt.Sprint(w) != fmt.Sprint(g) {
			t.Errorf("%s: direct %v, through onceproxy %v", what, w, g)
		}
	}
	check("JA4", want.JA4, got.JA4)
	check("JA3", want.JA3, got.JA3)
	check("TLS version", want.TLSVersion, got.TLSVersion)
	check("ALPN", want.ALPN, got.ALPN)
	check("HTTP version", want.Proto, got.Proto)
	check("Akamai", want.Akamai, got.Akamai)
	check("SNI", want.Hello.ServerName, got.Hello.ServerName)
	if want.Shape == nil || got.Shape == nil {
		t.Fatalf("no shape recorded: direct %v, proxied %v", want.Shape, got.Shape)
	}
	check("header order", withoutHop(want.Shape.HeaderOrder), withoutHop(got.Shape.HeaderOrder))
	check("pseudo-header order", want.Shape.PseudoOrder, got.Shape.PseudoOrder)
	check("HEADERS priority", want.Shape.Priority != nil, got.Shape.Priority != nil)
}

// goFPClient is a Go client with its own TLS settings, through proxy
// (nil: direct), trusting roots.
func goFPClient(t testing.TB, proxy *url.URL, roots *x509.CertPool, h2 bool, tweak func(*tls.Config)) *http.Client {
	cfg := &tls.Config{RootCAs: roots}
	if tweak != nil {
		tweak(cfg)
	}
	tr := &http.Transport{TLSClientConfig: cfg, ForceAttemptHTTP2: h2, DisableCompression: true}
	if proxy != nil {
		tr.Proxy = http.ProxyURL(proxy)
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: time.Minute}
}

func mustFetch(t testing.TB, c *http.Client, u string, hdr ...string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, u, nil)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", u, err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("GET %s: %s", u, resp.Status)
	}
	return resp
}

// TestGoClientsMirroredThroughProxy: Go's HTTP/1.1 and HTTP/2 clients look
// the same to the origin through onceproxy as directly, on the HTTP port
// and the SOCKS5 port, leaving directly and through an upstream session's
// HTTP CONNECT and SOCKS5 gateways (the mirrored TLS runs end to end
// inside the gateway's tunnel).
func TestGoClientsMirroredThroughProxy(t *testing.T) {
	origin := startFPOrigin(t, fporigin.Options{})
	base := "https://localhost:" + origin.Port()
	provider := fakeprovider.Start(t, fakeprovider.Options{})
	for _, egress := range []struct {
		name string
		url  string
	}{{"direct", ""}, {"CONNECT session", provider.URL("s1", "http")}, {"SOCKS5 session", provider.URL("s1", "socks5")}} {
		t.Run(egress.name, func(t *testing.T) {
			w := newWorld(t, worldOpts{socks5: &socks.Config{AllowNoAuth: true},
				upstream: upstream.Config{URL: egress.url, CAFiles: []string{origin.CAFile()}}})
			for _, door := range []struct {
				name  string
				proxy *url.URL
			}{{"http port", w.proxyURL}, {"socks5 port", &url.URL{Scheme: "socks5", Host: w.socksAddr}}} {
				for _, h2 := range []bool{false, true} {
					name := fmt.Sprintf("%s/h2=%v", door.name, h2)
					t.Run(name, func(t *testing.T) {
						path := "/" + strings.NewReplacer(" ", "-", "/", "-", "=", "-").Replace(egress.name+"-"+name)
						mustFetch(t, goFPClient(t, nil, origin.CertPool(), h2, nil), base+path+"-direct", "X-Test", "1")
						want := recordOf(t, origin, path+"-direct")
						mustFetch(t, goFPClient(t, door.proxy, w.caPool, h2, nil), base+path, "X-Test", "1")
						got := recordOf(t, origin, path)
						sameFingerprint(t, want, got)
						if wantProto := map[bool]string{false: "HTTP/1.1", true: "HTTP/2.0"}[h2]; got.Proto != wantProto {
							t.Errorf("origin saw %s, want %s", got.Proto, wantProto)
						}
					})
				}
			}
			if n := w.up.HelloCounts(); n["mirrored"] == 0 || n["closest"] != 0 || n["go"] != 0 {
				t.Errorf("upstream connections by hello: %v, want all mirrored", n)
			}
		})
	}
}

// TestFingerprintGoIsNetHTTP: with upstream.fingerprint: go, the origin
// sees Go's transport whatever the client: the comparison above fails, so
// it can tell.
func TestFingerprintGoIsNetHTTP(t *testing.T) {
	origin := startFPOrigin(t, fporigin.Options{})
	base := "https://localhost:" + origin.Port()
	w := newWorld(t, worldOpts{upstream: upstream.Config{Fingerprint: upstream.FingerprintGo, CAFiles: []string{origin.CAFile()}}})
	tls12 := func(c *tls.Config) { c.MaxVersion = tls.VersionTLS12 }
	mustFetch(t, goFPClient(t, nil, origin.CertPool(), false, tls12), base+"/direct")
	mustFetch(t, goFPClient(t, w.proxyURL, w.caPool, false, tls12), base+"/proxied")
	want, got := recordOf(t, origin, "/direct"), recordOf(t, origin, "/proxied")
	if want.JA4 == got.JA4 || got.Proto != "HTTP/2.0" {
		t.Errorf("fingerprint: go: direct %s %s, proxied %s %s: want Go's transport (another JA4, HTTP/2)",
			want.JA4, want.Proto, got.JA4, got.Proto)
	}
	if n := w.up.HelloCounts(); n["mirrored"] != 0 || n["go"] != 1 {
		t.Errorf("upstream connections by hello: %v, want one go", n)
	}
}

// TestFingerprintsNeverShareAConnection: two clients with different
// fingerprints hammer one origin through one session at once; every
// origin connection carries the requests of one fingerprint only, and
// each fingerprint's HTTP/2 requests share one connection, as a browser's
// would.
func TestFingerprintsNeverShareAConnection(t *testing.T) {
	origin := startFPOrigin(t, fporigin.Options{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(5 * time.Millisecond) // keep requests overlapping
		io.WriteString(w, "ok")
	})})
	base := "https://localhost:" + origin.Port()
	w := newWorld(t, worldOpts{upstream: upstream.Config{CAFiles: []string{origin.CAFile()}}})
	clients := map[string]*http.Client{
		"go-default": goFPClient(t, w.proxyURL, w.caPool, true, nil),
		"go-p256":    goFPClient(t, w.proxyURL, w.caPool, true, func(c *tls.Config) { c.CurvePreferences = []tls.CurveID{tls.CurveP256} }),
		"go-h1":      goFPClient(t, w.proxyURL, w.caPool, false, nil),
	}
	const each = 30
	var wg sync.WaitGroup
	for name, c := range clients {
		for i := range each {
			wg.Go(func() { mustFetch(t, c, fmt.Sprintf("%s/%s/%d", base, name, i)) })
		}
	}
	wg.Wait()
	recs := origin.Records()
	if len(recs) != len(clients)*each {
		t.Fatalf("origin recorded %d requests, want %d", len(recs), len(clients)*each)
	}
	byConn := map[int]map[string]bool{}   // connection -> clients seen on it
	byClient := map[string]map[int]bool{} // client -> its connections
	ids := map[string]fingerprint.ID{}
	for _, r := range recs {
		name := strings.Split(r.Path, "/")[1]
		if byConn[r.Conn] == nil {
			byConn[r.Conn] = map[string]bool{}
		}
		byConn[r.Conn][name] = true
		if byClient[name] == nil {
			byClient[name] = map[int]bool{}
		}
		byClient[name][r.Conn] = true
		ids[name] = fingerprint.New(r.Hello, r.H2).ID()
	}
	for conn, names := range byConn {
		if len(names) != 1 {
			t.Errorf("origin connection %d carried the requests of %v", conn, names)
		}
	}
	if ids["go-default"] == ids["go-p256"] || ids["go-default"] == ids["go-h1"] {
		t.Fatalf("the clients' fingerprints are not distinct: %v", ids)
	}
	for _, name := range []string{"go-default", "go-p256"} {
		if n := len(byClient[name]); n != 1 {
			t.Errorf("%s: %d HTTP/2 origin connections for %d requests, want 1", name, n, each)
		}
	}
	if n := len(byClient["go-h1"]); n < 1 || n > each {
		t.Errorf("go-h1: %d origin connections", n)
	}
	// Later requests reuse the pooled connections.
	before := len(byClient["go-h1"])
	for i := range 5 {
		mustFetch(t, clients["go-h1"], fmt.Sprintf("%s/go-h1/again-%d", base, i))
	}
	conns := map[int]bool{}
	for _, r := range origin.Records()[len(recs):] {
		conns[r.Conn] = true
		if !byClient["go-h1"][r.Conn] {
			t.Errorf("a later request of go-h1 came on a new connection %d (had %d)", r.Conn, before)
		}
	}
}

// rawH1 writes a request head with exactly these lines on c and reads the
// response.
func rawH1(t *testing.T, c net.Conn, br *bufio.Reader, head string) *http.Response {
	t.Helper()
	_ = c.SetDeadline(time.Now().Add(15 * time.Second))
	if _, err := io.WriteString(c, head); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp
}

// TestHeaderOrderAndCaseReachTheOrigin: an HTTP/1.1 client's header order
// and spelling reach the origin, on plain http:// proxy requests, inside
// plain and TLS tunnels, and through the SOCKS5 port; hop-by-hop fields and
// onceproxy's own stay behind. With fingerprint: go they do not (net/http
// sorts and canonicalizes), which the same comparison catches.
func TestHeaderOrderAndCaseReachTheOrigin(t *testing.T) {
	plain := startFPOrigin(t, fporigin.Options{Plain: true})
	secure := startFPOrigin(t, fporigin.Options{})
	want := []string{"Host", "X-Zeta", "accept", "X-alpha", "User-Agent"}
	head := func(target, host string) string {
		return "GET " + target + " HTTP/1.1\r\nHost: " + host + "\r\nX-Zeta: 1\r\naccept: */*\r\nX-alpha: 2\r\n" +
			"User-Agent: raw/1\r\nProxy-Connection: keep-alive\r\nX-Onceproxy-Session: s1\r\n\r\n"
	}
	for _, mode := range []string{upstream.FingerprintMirror, upstream.FingerprintGo} {
		t.Run(mode, func(t *testing.T) {
			w := newWorld(t, worldOpts{socks5: &socks.Config{AllowNoAuth: true},
				upstream: upstream.Config{Fingerprint: mode, CAFiles: []string{secure.CAFile()}}})
			paths := map[string]*fporigin.Origin{}

			// Absolute-form on the proxy port.
			c, err := net.Dial("tcp", w.proxyURL.Host)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			rawH1(t, c, bufio.NewReader(c), head(plain.URL()+"/"+mode+"-port", plain.Addr()))
			paths["/"+mode+"-port"] = plain

			// Inside a plain tunnel and a TLS one.
			tun := insideTunnel(t, w, plain.Addr(), false)
			rawH1(t, tun, bufio.NewReader(tun), head("/"+mode+"-tunnel", plain.Addr()))
			paths["/"+mode+"-tunnel"] = plain
			tlsTun := insideTunnel(t, w, secure.Addr(), true)
			rawH1(t, tlsTun, bufio.NewReader(tlsTun), head("/"+mode+"-tls", secure.Addr()))
			paths["/"+mode+"-tls"] = secure

			// Through the SOCKS5 port.
			sc := socks5Conn(t, w.socksAddr, plain.Addr())
			rawH1(t, sc, bufio.NewReader(sc), head("/"+mode+"-socks5", plain.Addr()))
			paths["/"+mode+"-socks5"] = plain

			for path, o := range paths {
				got := recordOf(t, o, path)
				if got.Shape == nil {
					t.Fatalf("%s: no shape recorded", path)
				}
				same := slices.Equal(got.Shape.HeaderOrder, want)
				if mode == upstream.FingerprintMirror && !same {
					t.Errorf("%s: origin saw %q, want %q", path, got.Shape.HeaderOrder, want)
				}
				if mode == upstream.FingerprintGo && same {
					t.Errorf("%s: fingerprint go kept the client's order %q", path, got.Shape.HeaderOrder)
				}
			}
		})
	}
}

// socks5Conn opens a SOCKS5 CONNECT to target through the door at addr.
func socks5Conn(t *testing.T, addr, target string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(15 * time.Second))
	host, port, _ := net.SplitHostPort(target)
	ip := net.ParseIP(host).To4()
	var p int
	fmt.Sscan(port, &p)
	msg := []byte{5, 1, 0, 5, 1, 0, 1}
	msg = append(msg, ip...)
	msg = append(msg, byte(p>>8), byte(p))
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	reply := make([]byte, 2+10)
	if _, err := io.ReadFull(c, reply); err != nil || reply[1] != 0 || reply[3] != 0 {
		t.Fatalf("SOCKS5 handshake: % x %v", reply, err)
	}
	return c
}

// TestClientFingerprintsShownAndCounted: a mirrored connection counts in
// onceproxy_upstream_connections_total{hello="mirrored"}, and the status
// page's source lists the client's JA4 once per client connection.
func TestClientFingerprintsShownAndCounted(t *testing.T) {
	origin := startFPOrigin(t, fporigin.Options{})
	base := "https://localhost:" + origin.Port()
	w := newWorld(t, worldOpts{upstream: upstream.Config{CAFiles: []string{origin.CAFile()}}})
	for i := range 3 {
		c := goFPClient(t, w.proxyURL, w.caPool, true, nil)
		mustFetch(t, c, fmt.Sprintf("%s/a%d", base, i))
		mustFetch(t, c, fmt.Sprintf("%s/b%d", base, i))
	}
	rec := recordOf(t, origin, "/a0")
	seen := w.srv.ClientFingerprints()
	if len(seen) != 1 || seen[0].JA4 != rec.JA4 || seen[0].Count != 3 || seen[0].HTTP != "h2" || seen[0].Akamai != rec.Akamai {
		t.Errorf("client fingerprints %+v, want %s (h2, %s) seen on 3 connections", seen, rec.JA4, rec.Akamai)
	}
	rr := httptest.NewRecorder()
	w.app.Metrics.Handler().ServeHTTP(rr, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	body := rr.Body.String()
	for _, line := range []string{
		`onceproxy_upstream_connections_total{hello="mirrored"} 1`,
		`onceproxy_upstream_connections_total{hello="closest"} 0`,
		`onceproxy_upstream_connections_total{hello="go"} 0`,
	} {
		if !strings.Contains(body, line) {
			t.Errorf("metrics lack %q", line)
		}
	}
}

// TestRefusedHelloGoesOutClosest: an origin that refuses the first
// mirrored hello (a middlebox, a picky TLS stack) costs the client
// nothing: the connection is opened again with the closest faithful hello,
// the request succeeds, and the metric and the debug log say so.
func TestRefusedHelloGoesOutClosest(t *testing.T) {
	var refused sync.Once
	origin := startFPOrigin(t, fporigin.Options{Refuse: func(*fingerprint.ClientHello) error {
		err := error(nil)
		refused.Do(func() { err = fmt.Errorf("refusing the first hello") })
		return err
	}})
	w := newWorld(t, worldOpts{upstream: upstream.Config{CAFiles: []string{origin.CAFile()}}})
	mustFetch(t, goFPClient(t, w.proxyURL, w.caPool, true, nil), "https://localhost:"+origin.Port()+"/refused-once")
	if n := w.up.HelloCounts(); n["closest"] != 1 || n["mirrored"] != 0 || n["go"] != 0 {
		t.Errorf("upstream connections by hello: %v, want one closest", n)
	}
	if !strings.Contains(w.logs.String(), "upstream connection hello differs from the client's") {
		t.Error("no debug line about the closest hello")
	}
}

// TestMirroredDirectDialsKeepTheGuard: a mirrored request that leaves
// directly resolves its origin through the pool's lookup seam and is
// checked at dial time: a public-looking name that resolves to loopback is
// refused (403) unless the guard allows loopback.
func TestMirroredDirectDialsKeepTheGuard(t *testing.T) {
	origin := startFPOrigin(t, fporigin.Options{Hosts: []string{"public.test"}})
	for _, allow := range []bool{false, true} {
		t.Run(fmt.Sprintf("loopback allowed=%v", allow), func(t *testing.T) {
			var looked sync.Map
			lookup := func(_ context.Context, _, host string) ([]netip.Addr, error) {
				looked.Store(host, true)
				return []netip.Addr{netip.MustParseAddr("127.0.0.1")}, nil
			}
			guard := &netguard.Config{}
			if allow {
				guard.AllowCIDRs = []string{"127.0.0.1/32"}
			}
			w := newWorld(t, worldOpts{guard: guard, upstreamOpts: []upstream.Option{upstream.WithLookup(lookup)},
				upstream: upstream.Config{CAFiles: []string{origin.CAFile()}}})
			resp, body := w.get(goFPClient(t, w.proxyURL, w.caPool, true, nil), "https://public.test:"+origin.Port()+"/guarded")
			if _, ok := looked.Load("public.test"); !ok {
				t.Error("the origin's name was not looked up through the pool's seam")
			}
			if allow {
				if resp.StatusCode != 200 || w.up.HelloCounts()["mirrored"] != 1 {
					t.Fatalf("allowed: %d %q, hellos %v", resp.StatusCode, body, w.up.HelloCounts())
				}
				return
			}
			if resp.StatusCode != 403 || resp.Header.Get("X-Onceproxy-Error") != "forbidden_target" {
				t.Fatalf("refused at dial time: %d %q", resp.StatusCode, body)
			}
		})
	}
}
