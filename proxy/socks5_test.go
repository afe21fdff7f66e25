package proxy_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/things-go/go-socks5"
	xproxy "golang.org/x/net/proxy"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/netguard"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

func socksOn(c socks.Config) *socks.Config { return &c }

// socksURL is the world's SOCKS5 port as a proxy URL, with credentials.
func (w *world) socksURL(user, pass string) *url.URL {
	u := &url.URL{Scheme: "socks5", Host: w.socksAddr}
	if user != "" {
		u.User = url.UserPassword(user, pass)
	}
	return u
}

// socksClient uses net/http's own SOCKS5 support (Transport.Proxy
// socks5://) and trusts only onceproxy's CA.
func (w *world) socksClient(user, pass string, h2 bool) *http.Client {
	return w.clientVia(http.ProxyURL(w.socksURL(user, pass)), nil, h2)
}

// xnetClient dials through golang.org/x/net/proxy's SOCKS5 dialer.
func (w *world) xnetClient(user, pass string, h2 bool) *http.Client {
	var auth *xproxy.Auth
	if user != "" {
		auth = &xproxy.Auth{User: user, Password: pass}
	}
	d, err := xproxy.SOCKS5("tcp", w.socksAddr, auth, xproxy.Direct)
	if err != nil {
		w.t.Fatal(err)
	}
	return w.clientVia(nil, d.(xproxy.ContextDialer).DialContext, h2)
}

func (w *world) clientVia(proxyFunc func(*http.Request) (*url.URL, error),
	dial func(ctx context.Context, network, addr string) (net.Conn, error), h2 bool) *http.Client {
	tr := &http.Transport{
		Proxy:              proxyFunc,
		DialContext:        dial,
		TLSClientConfig:    &tls.Config{RootCAs: w.caPool},
		ForceAttemptHTTP2:  h2,
		DisableCompression: true,
	}
	if !h2 {
		tr.TLSClientConfig.NextProtos = []string{"http/1.1"}
		tr.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	}
	w.t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

// getT is world.get reporting to t (safe inside subtests).
func getT(t *testing.T, c *http.Client, u string) (*http.Response, string) {
	t.Helper()
	resp, err := c.Get(u)
	if err != nil {
		t.Fatalf("GET %s: %v", u, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: read body: %v", u, err)
	}
	return resp, string(b)
}

func portOf(t testing.TB, rawURL string) int {
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	p, err := strconv.Atoi(u.Port())
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// recordingUpstream wraps the world's upstream: it records blind-tunnel
// dials (address and client identity) and can fail chosen addresses.
type recordingUpstream struct {
	proxy.Upstream
	fail map[string]error

	mu    sync.Mutex
	dials []string
	infos []clientinfo.Info
}

func (r *recordingUpstream) wrap(up proxy.Upstream) proxy.Upstream {
	r.Upstream = up
	return r
}

func (r *recordingUpstream) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	r.mu.Lock()
	r.dials = append(r.dials, addr)
	r.infos = append(r.infos, clientinfo.From(ctx))
	r.mu.Unlock()
	if err := r.fail[addr]; err != nil {
		return nil, err
	}
	return r.Upstream.DialContext(ctx, network, addr)
}

func (r *recordingUpstream) recorded() ([]string, []clientinfo.Info) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.dials...), append([]clientinfo.Info(nil), r.infos...)
}

// TestSOCKS5ThroughMITM: HTTPS and plain HTTP through the SOCKS5 port get
// the MITM and the dedup layer, with net/http's SOCKS5 client and
// golang.org/x/net/proxy, over HTTP/1.1 and HTTP/2 inside the tunnel, on a
// MITM port (answered at once, nothing dialled) and on another port
// (dialled first, then intercepted anyway).
func TestSOCKS5ThroughMITM(t *testing.T) {
	tlsA := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	tlsB := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	plainA := plainOrigin(t, http.HandlerFunc(echoProto))
	plainB := plainOrigin(t, http.HandlerFunc(echoProto))
	rec := &recordingUpstream{}
	w := newWorld(t, worldOpts{
		originCAs:    []*x509.Certificate{tlsA.Certificate(), tlsB.Certificate()},
		dedup:        dedupOn(dedup.Config{}),
		socks5:       socksOn(socks.Config{AllowNoAuth: true, MITMPorts: []int{portOf(t, tlsA.URL), portOf(t, plainA.URL)}}),
		wrapUpstream: rec.wrap,
	})
	clients := []struct {
		name string
		mk   func(user, pass string, h2 bool) *http.Client
	}{{"net/http", w.socksClient}, {"x-net-proxy", w.xnetClient}}

	for _, path := range []struct {
		name       string
		tls, plain string
		dials      bool
	}{
		{"mitm-port", tlsA.URL, plainA.URL, false},
		{"other-port", tlsB.URL, plainB.URL, true},
	} {
		for _, cl := range clients {
			for _, h2 := range []bool{false, true} {
				name := fmt.Sprintf("%s/%s/h2=%v", path.name, cl.name, h2)
				t.Run(name, func(t *testing.T) {
					before, _ := rec.recorded()
					c := cl.mk("scraper", "pw", h2)
					u := path.tls + "/" + name
					for i, want := range []string{"MISS", "HIT"} {
						resp, body := getT(t, c, u)
						if resp.StatusCode != 200 || !strings.Contains(body, "path=/"+name) {
							t.Fatalf("status %d body %q", resp.StatusCode, body)
						}
						if got := resp.Header.Get("X-Cache"); got != want {
							t.Errorf("request %d: X-Cache = %q, want %q", i, got, want)
						}
						if want := map[bool]int{false: 1, true: 2}[h2]; resp.ProtoMajor != want {
							t.Errorf("client proto %s, want major %d", resp.Proto, want)
						}
						chains := resp.TLS.VerifiedChains
						if len(chains) == 0 || !chains[0][len(chains[0])-1].Equal(w.ca.Certificate()) {
							t.Errorf("verified chain does not end at the onceproxy CA")
						}
					}
					resp, body := getT(t, c, path.plain+"/"+name)
					if resp.StatusCode != 200 || body != "proto=HTTP/1.1 path=/"+name || resp.Header.Get("X-Cache") != "MISS" {
						t.Errorf("plain http: %d X-Cache %q body %q", resp.StatusCode, resp.Header.Get("X-Cache"), body)
					}
					after, _ := rec.recorded()
					if dialled := len(after) > len(before); dialled != path.dials {
						t.Errorf("blind-tunnel dials %v, want dials=%v", after[len(before):], path.dials)
					}
				})
			}
		}
	}
}

// TestSOCKS5Curl is the README's example: curl --socks5-hostname with the
// CA file, HTTP/1.1 and HTTP/2, X-Cache on the answer.
func TestSOCKS5Curl(t *testing.T) {
	curl, err := exec.LookPath("curl")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("curl not found; CI must install it")
		}
		t.Skip("curl not installed")
	}
	origin := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	plain := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{
		originCAs: []*x509.Certificate{origin.Certificate()},
		dedup:     dedupOn(dedup.Config{}),
		socks5:    socksOn(socks.Config{MITMPorts: []int{portOf(t, origin.URL)}}),
		users:     map[string]string{"curl-user": "s3cret"},
	})
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"https http1.1", []string{"--http1.1", origin.URL + "/c1"}, "HTTP/1.1 200"},
		{"https http2", []string{"--http2", origin.URL + "/c2"}, "HTTP/2 200"},
		{"plain http", []string{plain.URL + "/c3"}, "HTTP/1.1 200"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, xcache := range []string{"miss", "hit"} {
				args := append([]string{"-sS", "-i", "--max-time", "20",
					"--socks5-hostname", "curl-user:s3cret@" + w.socksAddr, "--cacert", w.caFile}, tc.args...)
				out, err := exec.Command(curl, args...).CombinedOutput()
				if err != nil {
					t.Fatalf("curl %v: %v\n%s", args, err, out)
				}
				lower := strings.ToLower(string(out))
				if !strings.Contains(string(out), tc.want) || !strings.Contains(lower, "x-cache: "+xcache) {
					t.Fatalf("curl output lacks %q or X-Cache %s:\n%s", tc.want, xcache, out)
				}
			}
		})
	}
}

// TestSOCKS5StampedeSplitWithHTTPPort: identical requests arriving half on
// the SOCKS5 port, half on the HTTP port, as the same proxy user, reach the
// origin once. The origin's port is a MITM port, as 443 would be.
func TestSOCKS5StampedeSplitWithHTTPPort(t *testing.T) {
	const n = 200
	var w *world
	var originHits atomic.Int64
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		originHits.Add(1)
		testkit.Wait(t, testkit.Patience, func() bool { return w.engine.Stats().Waiters == n }, "all waiters")
		fmt.Fprintf(rw, "page %d", time.Now().UnixNano())
	}), false)
	w = newWorld(t, worldOpts{
		originCAs: []*x509.Certificate{origin.Certificate()},
		dedup:     dedupOn(dedup.Config{}),
		socks5:    socksOn(socks.Config{AllowNoAuth: true, MITMPorts: []int{portOf(t, origin.URL)}}),
	})
	socksC := w.socksClient("fleet", "pw", false)
	httpURL := *w.proxyURL
	httpURL.User = url.UserPassword("fleet", "pw")
	httpC := w.clientVia(http.ProxyURL(&httpURL), nil, false)

	results := make(chan fetched, n)
	for i := range n {
		c := httpC
		if i%2 == 0 {
			c = socksC
		}
		go func() { results <- fetch(context.Background(), c, origin.URL+"/split") }()
	}
	counts := map[string]int{}
	var first string
	for range n {
		r := <-results
		if r.err != nil || r.status != 200 {
			t.Fatalf("request failed: %+v", r)
		}
		if first == "" {
			first = r.body
		} else if r.body != first {
			t.Fatalf("bodies differ: %q vs %q", r.body, first)
		}
		counts[r.xcache]++
	}
	if got := originHits.Load(); got != 1 {
		t.Fatalf("origin saw %d requests, want 1", got)
	}
	if counts["MISS"] != 1 || counts["COALESCED"] != n-1 {
		t.Fatalf("X-Cache counts %v", counts)
	}
}

// echoServer echoes every connection until the client half-closes, then
// writes tail and closes: a client that half-closes must still read it.
func echoServer(t testing.TB, banner, tail string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns []net.Conn
	)
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(30 * time.Second))
				if banner != "" {
					io.WriteString(c, banner)
				}
				if _, err := io.Copy(c, c); err != nil {
					return
				}
				io.WriteString(c, tail)
			}()
		}
	}()
	return ln.Addr().String()
}

// socksDial opens a SOCKS5 CONNECT with golang.org/x/net/proxy.
func socksDial(t testing.TB, w *world, user, pass, target string) net.Conn {
	t.Helper()
	var auth *xproxy.Auth
	if user != "" {
		auth = &xproxy.Auth{User: user, Password: pass}
	}
	d, err := xproxy.SOCKS5("tcp", w.socksAddr, auth, xproxy.Direct)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := d.(xproxy.ContextDialer).DialContext(ctx, "tcp", target)
	if err != nil {
		t.Fatalf("SOCKS5 CONNECT %s: %v", target, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// socksTunnelTCP opens a no-auth SOCKS5 CONNECT by hand and returns the
// TCP connection itself (x/net/proxy's connection hides CloseWrite).
func socksTunnelTCP(t testing.TB, w *world, target string) *net.TCPConn {
	t.Helper()
	host, port, _ := net.SplitHostPort(target)
	p, _ := strconv.Atoi(port)
	r := dialRaw(t, w)
	if got := r.greet(0); !bytes.Equal(got, []byte{5, 0}) {
		t.Fatalf("greet: % x", got)
	}
	if code := r.request(1, host, p); code != 0 {
		t.Fatalf("CONNECT %s: reply %d", target, code)
	}
	_ = r.c.SetDeadline(time.Time{})
	return r.c.(*net.TCPConn)
}

// TestSOCKS5RawTCPTunnel: a protocol that is neither TLS nor HTTP is
// tunnelled untouched, with half-close: the client shuts its sending side
// and still reads the echo and the tail the server sends after EOF. On a
// MITM port too (sniffed, then dialled).
func TestSOCKS5RawTCPTunnel(t *testing.T) {
	echo := echoServer(t, "", "TAIL")
	for _, tc := range []struct {
		name  string
		ports []int
	}{{"other-port", nil}, {"mitm-port", []int{portOf(t, "tcp://"+echo)}}} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, worldOpts{socks5: socksOn(socks.Config{AllowNoAuth: true, MITMPorts: tc.ports})})
			c := socksTunnelTCP(t, w, echo)
			data := make([]byte, 1<<20)
			rand.Read(data)
			data[0] = 0 // neither a TLS record nor a method: never intercepted
			werr := make(chan error, 1)
			go func() {
				_, err := c.Write(data)
				if err == nil {
					err = c.CloseWrite()
				}
				werr <- err
			}()
			_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
			got, err := io.ReadAll(c)
			if err != nil {
				t.Fatalf("read: %v (after %d bytes)", err, len(got))
			}
			if err := <-werr; err != nil {
				t.Fatalf("write: %v", err)
			}
			if !bytes.Equal(got, append(data, "TAIL"...)) {
				t.Fatalf("tunnel altered the stream: got %d bytes, want %d + tail", len(got), len(data))
			}
			if w.ca.Stats().Mints != 0 {
				t.Error("a certificate was minted for a raw TCP tunnel")
			}
		})
	}
}

// TestSOCKS5ServerSpeaksFirst: on another port the upstream's banner
// arrives at once (the upstream speaking first ends the sniff); on a MITM
// port it arrives after the client stayed silent for sniff_timeout.
func TestSOCKS5ServerSpeaksFirst(t *testing.T) {
	banner := echoServer(t, "220 ready\r\n", "")
	port := portOf(t, "tcp://"+banner)
	for _, tc := range []struct {
		name       string
		cfg        socks.Config
		min, below time.Duration
	}{
		{"other-port", socks.Config{AllowNoAuth: true, SniffTimeout: 5 * time.Second}, 0, 4 * time.Second},
		{"mitm-port", socks.Config{AllowNoAuth: true, SniffTimeout: 300 * time.Millisecond, MITMPorts: []int{port}}, 300 * time.Millisecond, 10 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, worldOpts{socks5: socksOn(tc.cfg)})
			start := time.Now()
			c := socksDial(t, w, "", "", banner)
			_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
			br := bufio.NewReader(c)
			line, err := br.ReadString('\n')
			took := time.Since(start)
			if err != nil || line != "220 ready\r\n" {
				t.Fatalf("banner %q, %v", line, err)
			}
			if took < tc.min || took >= tc.below {
				t.Errorf("banner after %v, want in [%v, %v)", took, tc.min, tc.below)
			}
			// And the tunnel carries the client's bytes afterwards.
			io.WriteString(c, "HELO x\r\n")
			if line, err := br.ReadString('\n'); err != nil || line != "HELO x\r\n" {
				t.Fatalf("echo %q, %v", line, err)
			}
		})
	}
}

// TestSOCKS5BypassHostIsBlind: a bypass host is tunnelled without
// interception, even on a MITM port: the client sees the origin's own
// certificate, and nothing is minted. A client that resolves names itself
// sends the CONNECT to an IP address: its TLS hello's server name then
// decides, and another name on the same address is intercepted.
func TestSOCKS5BypassHostIsBlind(t *testing.T) {
	origin := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	for _, byName := range []bool{false, true} {
		for _, tc := range []struct {
			name  string
			ports []int
		}{{"mitm-port", []int{portOf(t, origin.URL)}}, {"other-port", nil}} {
			t.Run(fmt.Sprintf("%s/by-name=%t", tc.name, byName), func(t *testing.T) {
				// httptest's certificate names example.com: by name, the
				// target is the origin's address and the name is only in
				// the hello.
				bypass, serverName := "127.0.0.1", ""
				if byName {
					bypass, serverName = "example.com", "example.com"
				}
				w := newWorld(t, worldOpts{
					proxy:  proxy.Config{BypassHosts: []string{bypass}},
					socks5: socksOn(socks.Config{AllowNoAuth: true, MITMPorts: tc.ports}),
				})
				pool := x509.NewCertPool()
				pool.AddCert(origin.Certificate())
				pool.AddCert(w.ca.Certificate())
				client := func(serverName string) *http.Client {
					return &http.Client{Transport: &http.Transport{
						Proxy:           http.ProxyURL(w.socksURL("u", "p")),
						TLSClientConfig: &tls.Config{RootCAs: pool, ServerName: serverName},
					}, Timeout: 10 * time.Second}
				}
				c := client(serverName)
				defer c.CloseIdleConnections()
				resp, body := getT(t, c, origin.URL+"/b")
				if resp.StatusCode != 200 || !strings.Contains(body, "path=/b") {
					t.Fatalf("got %d %q", resp.StatusCode, body)
				}
				if !resp.TLS.PeerCertificates[0].Equal(origin.Certificate()) {
					t.Fatal("client did not see the origin's own certificate")
				}
				if w.ca.Stats().Mints != 0 {
					t.Fatal("a certificate was minted for a bypass host")
				}
				if !byName {
					return
				}
				other := client("other.localhost")
				defer other.CloseIdleConnections()
				resp, _ = getT(t, other, origin.URL+"/c")
				if resp.TLS.PeerCertificates[0].Equal(origin.Certificate()) || w.ca.Stats().Mints != 1 {
					t.Fatalf("a host not on the bypass list went blind (%d mints)", w.ca.Stats().Mints)
				}
			})
		}
	}
}

// rawSOCKS speaks SOCKS5 byte by byte, to check replies exactly.
type rawSOCKS struct {
	t testing.TB
	c net.Conn
}

func dialRaw(t testing.TB, w *world) *rawSOCKS {
	t.Helper()
	c, err := net.DialTimeout("tcp", w.socksAddr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return &rawSOCKS{t, c}
}

func (r *rawSOCKS) send(b []byte) {
	r.t.Helper()
	if _, err := r.c.Write(b); err != nil {
		r.t.Fatalf("write: %v", err)
	}
}

func (r *rawSOCKS) read(n int) []byte {
	r.t.Helper()
	b := make([]byte, n)
	if _, err := io.ReadFull(r.c, b); err != nil {
		r.t.Fatalf("read %d bytes: %v", n, err)
	}
	return b
}

func (r *rawSOCKS) greet(methods ...byte) []byte {
	r.t.Helper()
	r.send(append([]byte{5, byte(len(methods))}, methods...))
	return r.read(2)
}

func (r *rawSOCKS) login(user, pass string) []byte {
	r.t.Helper()
	b := append([]byte{1, byte(len(user))}, user...)
	b = append(append(b, byte(len(pass))), pass...)
	r.send(b)
	return r.read(2)
}

// request sends a command for host:port and returns the reply code.
func (r *rawSOCKS) request(cmd byte, host string, port int) byte {
	r.t.Helper()
	b := []byte{5, cmd, 0}
	if ip := net.ParseIP(host).To4(); ip != nil {
		b = append(append(b, 1), ip...)
	} else {
		b = append(append(b, 3, byte(len(host))), host...)
	}
	r.send(append(b, byte(port>>8), byte(port)))
	rep := r.read(4)
	switch rep[3] {
	case 1:
		r.read(6)
	case 4:
		r.read(18)
	default:
		r.t.Fatalf("reply with address type %d", rep[3])
	}
	return rep[1]
}

// expectClosed asserts the server hangs up (not our read deadline).
func (r *rawSOCKS) expectClosed() {
	r.t.Helper()
	_, err := io.ReadAll(r.c)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		r.t.Fatalf("the server kept the connection open: %v", err)
	}
}

// TestSOCKS5Refusals: each malformed or refused exchange gets its exact
// reply, and the server keeps serving.
func TestSOCKS5Refusals(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{
		proxy:  proxy.Config{ReadHeaderTimeout: 500 * time.Millisecond},
		socks5: socksOn(socks.Config{}),
		users:  map[string]string{"u": "good"},
	})
	login := func(r *rawSOCKS) {
		r.t.Helper()
		if got := r.greet(2); !bytes.Equal(got, []byte{5, 2}) {
			r.t.Fatalf("method reply % x", got)
		}
		if got := r.login("u", "good"); !bytes.Equal(got, []byte{1, 0}) {
			r.t.Fatalf("login reply % x", got)
		}
	}
	for _, tc := range []struct {
		name string
		run  func(t *testing.T, r *rawSOCKS)
	}{
		{"wrong password", func(t *testing.T, r *rawSOCKS) {
			if got := r.greet(0, 2); !bytes.Equal(got, []byte{5, 2}) {
				t.Fatalf("method reply % x, want 05 02", got)
			}
			if got := r.login("u", "bad"); !bytes.Equal(got, []byte{1, 1}) {
				t.Fatalf("auth reply % x, want 01 01", got)
			}
		}},
		{"unknown user", func(t *testing.T, r *rawSOCKS) {
			r.greet(2)
			if got := r.login("nobody", "good"); !bytes.Equal(got, []byte{1, 1}) {
				t.Fatalf("auth reply % x, want 01 01", got)
			}
		}},
		{"no-auth only", func(t *testing.T, r *rawSOCKS) {
			if got := r.greet(0); !bytes.Equal(got, []byte{5, 0xff}) {
				t.Fatalf("method reply % x, want 05 ff", got)
			}
		}},
		{"UDP ASSOCIATE", func(t *testing.T, r *rawSOCKS) {
			login(r)
			if got := r.request(3, "0.0.0.0", 0); got != 7 {
				t.Fatalf("reply %d, want 7 (command not supported)", got)
			}
		}},
		{"BIND", func(t *testing.T, r *rawSOCKS) {
			login(r)
			if got := r.request(2, "127.0.0.1", 9); got != 7 {
				t.Fatalf("reply %d, want 7 (command not supported)", got)
			}
		}},
		{"unknown command", func(t *testing.T, r *rawSOCKS) {
			login(r)
			if got := r.request(9, "127.0.0.1", 9); got != 7 {
				t.Fatalf("reply %d, want 7", got)
			}
		}},
		{"unknown address type", func(t *testing.T, r *rawSOCKS) {
			login(r)
			r.send([]byte{5, 1, 0, 9, 1, 2, 3, 4, 0, 80})
			if got := r.read(4); got[1] != 8 {
				t.Fatalf("reply % x, want code 8", got)
			}
		}},
		{"empty host name", func(t *testing.T, r *rawSOCKS) {
			login(r)
			if got := r.request(1, "", 80); got != 1 {
				t.Fatalf("reply %d, want 1", got)
			}
		}},
		{"garbage greeting (HTTP)", func(t *testing.T, r *rawSOCKS) {
			r.send([]byte("GET http://example.test/ HTTP/1.1\r\nHost: example.test\r\n\r\n"))
			resp, err := http.ReadResponse(bufio.NewReader(r.c), nil)
			if err != nil || resp.StatusCode != 400 {
				t.Fatalf("want a 400 naming the SOCKS5 port: %v %v", resp, err)
			}
		}},
		{"garbage greeting (SOCKS4)", func(t *testing.T, r *rawSOCKS) {
			r.send([]byte{4, 1, 0, 80, 127, 0, 0, 1, 0})
			if got := r.read(2); !bytes.Equal(got, []byte{0, 0x5b}) {
				t.Fatalf("reply % x, want SOCKS4 rejection 00 5b", got)
			}
		}},
		{"garbage greeting (binary)", func(t *testing.T, r *rawSOCKS) {
			r.send([]byte{0xff, 0xfe, 0xfd})
		}},
		{"truncated greeting", func(t *testing.T, r *rawSOCKS) {
			// Then silence: cut by the handshake deadline (500ms here).
			r.send([]byte{5, 3, 0})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := dialRaw(t, w)
			start := time.Now()
			tc.run(t, r)
			r.expectClosed()
			if took := time.Since(start); took > 5*time.Second {
				t.Errorf("closed after %v", took)
			}
			// The server keeps serving.
			if resp, body := getT(t, w.socksClient("u", "good", false), origin.URL+"/after"); resp.StatusCode != 200 {
				t.Fatalf("after %s: %d %q", tc.name, resp.StatusCode, body)
			}
		})
	}
	if !strings.Contains(w.logs.String(), "socks5: authentication failed") {
		t.Error("failed logins are not logged")
	}
}

// TestSOCKS5NoUserStoreNoAuthRefusesEveryone: without a user store and
// without allow_no_auth nobody gets in, and the log says why.
func TestSOCKS5NoUserStoreNoAuthRefusesEveryone(t *testing.T) {
	w := newWorld(t, worldOpts{socks5: socksOn(socks.Config{})})
	for _, methods := range [][]byte{{0}, {2}, {0, 2}, {0xff}} {
		r := dialRaw(t, w)
		if got := r.greet(methods...); !bytes.Equal(got, []byte{5, 0xff}) {
			t.Fatalf("methods % x: reply % x, want 05 ff", methods, got)
		}
		r.expectClosed()
	}
	testkit.Eventually(t, testkit.Patience, func() bool {
		return strings.Contains(w.logs.String(), "socks5.allow_no_auth is false")
	}, "the refusal logged")
	if !strings.Contains(w.logs.String(), "every SOCKS5 client will be refused") {
		t.Error("no start-up line saying every client will be refused")
	}
}

// TestSOCKS5AllowNoAuth: without a user store, allow_no_auth lets in both
// no-auth clients and clients with any user name (asked for first, so that
// session hints are not lost), except a name a Basic header cannot carry.
func TestSOCKS5AllowNoAuth(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{socks5: socksOn(socks.Config{AllowNoAuth: true})})
	if got := dialRaw(t, w).greet(0); !bytes.Equal(got, []byte{5, 0}) {
		t.Fatalf("no-auth: % x", got)
	}
	r := dialRaw(t, w)
	if got := r.greet(0, 2); !bytes.Equal(got, []byte{5, 2}) {
		t.Fatalf("both offered: % x, want user/password chosen", got)
	}
	if got := r.login("anyone-session-x", "anything"); !bytes.Equal(got, []byte{1, 0}) {
		t.Fatalf("login: % x", got)
	}
	r = dialRaw(t, w)
	r.greet(2)
	if got := r.login("a:b", "x"); !bytes.Equal(got, []byte{1, 1}) {
		t.Fatalf("user with a colon: % x, want refused", got)
	}
	for _, user := range []string{"", "someone"} {
		if resp, _ := getT(t, w.socksClient(user, "pw", false), origin.URL+"/x"); resp.StatusCode != 200 {
			t.Fatalf("user %q: %d", user, resp.StatusCode)
		}
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// TestSOCKS5SessionHintReachesPipeline: the SOCKS5 user name reaches the
// stages behind the front door exactly as a Proxy-Authorization user does:
// account and session parsed, for intercepted requests and blind tunnels.
func TestSOCKS5SessionHintReachesPipeline(t *testing.T) {
	tlsO := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	plain := plainOrigin(t, http.HandlerFunc(echoProto))
	echo := echoServer(t, "", "")
	// An unverified name is no client of its own: the limits count its
	// address.
	for _, tc := range []struct {
		name   string
		users  map[string]string
		client string
	}{{"unverified", nil, "ip:127.0.0.1"}, {"verified", map[string]string{"acct": "pw"}, "user:acct"}} {
		t.Run(tc.name, func(t *testing.T) {
			want := clientinfo.Info{User: "acct-session-s1", Account: "acct", Session: "s1", Client: tc.client}
			seen := make(chan clientinfo.Info, 8)
			rec := &recordingUpstream{}
			w := newWorld(t, worldOpts{
				originCAs: []*x509.Certificate{tlsO.Certificate()},
				next: func(up http.RoundTripper) http.RoundTripper {
					return roundTripFunc(func(r *http.Request) (*http.Response, error) {
						seen <- clientinfo.From(r.Context())
						return up.RoundTrip(r)
					})
				},
				socks5:       socksOn(socks.Config{AllowNoAuth: true}),
				users:        tc.users,
				wrapUpstream: rec.wrap,
			})
			for _, u := range []string{tlsO.URL + "/s", plain.URL + "/s"} {
				for _, h2 := range []bool{false, true} {
					if resp, body := getT(t, w.socksClient("acct-session-s1", "pw", h2), u); resp.StatusCode != 200 {
						t.Fatalf("%s: %d %q", u, resp.StatusCode, body)
					}
					if got := <-seen; got != want {
						t.Errorf("%s h2=%v: pipeline saw %+v, want %+v", u, h2, got, want)
					}
				}
			}
			c := socksDial(t, w, "acct-session-s1", "pw", echo)
			c.Write([]byte{0})
			c.Read(make([]byte, 1))
			_, infos := rec.recorded()
			if n := len(infos); n == 0 || infos[n-1] != want {
				t.Errorf("blind tunnel dialled with %+v, want %+v", infos, want)
			}
		})
	}
}

// TestSOCKS5DialFailuresMapToReplies: a CONNECT to another port is dialled
// before the reply, so failures get their RFC 1928 code; host names reach
// the upstream unresolved.
func TestSOCKS5DialFailuresMapToReplies(t *testing.T) {
	dead := testkit.DeadAddr(t)
	deadHost, deadPort, _ := net.SplitHostPort(dead)
	dp, _ := strconv.Atoi(deadPort)
	rec := &recordingUpstream{fail: map[string]error{
		"no-such-host.test:9999": &upstream.DialError{Op: "dial no-such-host.test:9999",
			Err: &net.OpError{Op: "dial", Net: "tcp", Err: &net.DNSError{Err: "no such host", Name: "no-such-host.test", IsNotFound: true}}},
		"blocked.test:9999": fmt.Errorf("dial blocked.test:9999: %w", forbidden{}),
		"slow.test:9999":    &upstream.DialError{Op: "dial slow.test:9999", Err: context.DeadlineExceeded},
		"unreach.test:9999": &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ENETUNREACH)},
		"broken.test:9999":  errors.New("something else broke"),
	}}
	origin := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{socks5: socksOn(socks.Config{AllowNoAuth: true}), wrapUpstream: rec.wrap})
	for _, tc := range []struct {
		host string
		port int
		want byte
	}{
		{deadHost, dp, 5},
		{"no-such-host.test", 9999, 4},
		{"blocked.test", 9999, 2},
		{"slow.test", 9999, 4},
		{"unreach.test", 9999, 3},
		{"broken.test", 9999, 1},
	} {
		t.Run(tc.host, func(t *testing.T) {
			r := dialRaw(t, w)
			if got := r.greet(0); !bytes.Equal(got, []byte{5, 0}) {
				t.Fatalf("greet % x", got)
			}
			if got := r.request(1, tc.host, tc.port); got != tc.want {
				t.Fatalf("reply %d, want %d", got, tc.want)
			}
			r.expectClosed()
		})
	}
	dials, _ := rec.recorded()
	found := false
	for _, d := range dials {
		found = found || d == "no-such-host.test:9999"
	}
	if !found {
		t.Errorf("the upstream never saw the name unresolved: dials %v", dials)
	}
	if resp, _ := getT(t, w.socksClient("", "", false), origin.URL+"/ok"); resp.StatusCode != 200 {
		t.Fatalf("after failures: %d", resp.StatusCode)
	}
}

type forbidden struct{}

func (forbidden) Error() string   { return "blocked by policy" }
func (forbidden) HTTPStatus() int { return http.StatusForbidden }

// TestSOCKS5IdleTunnelIsClosed: a SOCKS5 tunnel on which nothing moves is
// cut after proxy.idle_timeout, as on the HTTP port.
func TestSOCKS5IdleTunnelIsClosed(t *testing.T) {
	echo := echoServer(t, "", "")
	w := newWorld(t, worldOpts{
		proxy:  proxy.Config{IdleTimeout: 300 * time.Millisecond},
		socks5: socksOn(socks.Config{AllowNoAuth: true}),
	})
	c := socksDial(t, w, "", "", echo)
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err := c.Read(make([]byte, 1))
	if err == nil {
		t.Fatal("read a byte from a silent tunnel")
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("the proxy never closed the idle tunnel (our own 10s deadline fired): %v", err)
	}
}

// TestSOCKS5ConnectionLimit: proxy.max_conns applies to the SOCKS5 port;
// a client beyond it waits until a slot frees.
func TestSOCKS5ConnectionLimit(t *testing.T) {
	w := newWorld(t, worldOpts{
		proxy:  proxy.Config{MaxConns: 1},
		socks5: socksOn(socks.Config{AllowNoAuth: true}),
	})
	a := dialRaw(t, w)
	if got := a.greet(0); !bytes.Equal(got, []byte{5, 0}) {
		t.Fatalf("first: % x", got)
	}
	b := dialRaw(t, w)
	b.send([]byte{5, 1, 0})
	_ = b.c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if _, err := b.c.Read(make([]byte, 1)); err == nil {
		t.Fatal("a second client was served beyond max_conns")
	}
	a.c.Close()
	_ = b.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if got := b.read(2); !bytes.Equal(got, []byte{5, 0}) {
		t.Fatalf("second after the first left: % x", got)
	}
}

// TestSOCKS5Shutdown: Shutdown stops the SOCKS5 port, lets an intercepted
// request in flight finish, then cuts blind tunnels, including one the
// client half-closed whose upstream never answers; ServeSOCKS5 returns nil
// (checked by the world's cleanup) and no goroutine is left behind.
func TestSOCKS5Shutdown(t *testing.T) {
	var release *testkit.Gate
	started := make(chan struct{}, 1)
	origin := tlsOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		if release.Wait(r.Context()) {
			io.WriteString(w, "finished")
		}
	}), false)
	echo := echoServer(t, "", "")
	// The sink reads until EOF, then waits without a word; sinkClosed
	// reports whether the proxy closed its side. (A read after the EOF,
	// as this test once waited with, returns at once: it could not fail.)
	sinkAddr, sinkClosed := silentSink(t)
	w := newWorld(t, worldOpts{
		originCAs: []*x509.Certificate{origin.Certificate()},
		socks5:    socksOn(socks.Config{AllowNoAuth: true}),
	})
	release = testkit.NewGate(t)
	half := socksTunnelTCP(t, w, sinkAddr)
	io.WriteString(half, "\x00bye")
	half.CloseWrite()
	tun := socksDial(t, w, "", "", echo)
	io.WriteString(tun, "ping")
	if b := make([]byte, 4); func() error { _, err := io.ReadFull(tun, b); return err }() != nil || string(b) != "ping" {
		t.Fatalf("tunnel does not echo: %q", b)
	}
	done := make(chan fetched, 1)
	go func() { done <- fetch(context.Background(), w.socksClient("", "", false), origin.URL+"/slow") }()
	<-started

	shut := make(chan error, 1)
	shutStart := time.Now()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		shut <- w.srv.Shutdown(ctx)
	}()
	testkit.Eventually(t, testkit.Patience, func() bool {
		c, err := net.Dial("tcp", w.socksAddr)
		if err != nil {
			return true
		}
		c.Close()
		return false
	}, "the SOCKS5 port to close")
	release.Open()
	if r := <-done; r.err != nil || r.status != 200 || r.body != "finished" {
		t.Fatalf("in-flight request over SOCKS5: %+v", r)
	}
	if err := <-shut; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if took := time.Since(shutStart); took > 4*time.Second {
		t.Errorf("Shutdown took %v", took)
	}
	for _, c := range []net.Conn{tun, half} {
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err := c.Read(make([]byte, 1))
		var ne net.Error
		if err == nil || errors.As(err, &ne) && ne.Timeout() {
			t.Fatalf("blind tunnel survived Shutdown: %v", err)
		}
	}
	if !sinkClosed() {
		t.Fatal("the upstream side of a half-closed tunnel was not closed")
	}
	if strings.Contains(w.logs.String(), "still running") {
		t.Error("Shutdown left SOCKS5 goroutines running")
	}
}

// TestSOCKS5ThroughUpstreamProxy: blind tunnels leave through the
// configured upstream proxy, SOCKS5 or HTTP CONNECT, byte for byte.
func TestSOCKS5ThroughUpstreamProxy(t *testing.T) {
	echo := echoServer(t, "", "TAIL")
	var socksDials atomic.Int64
	upSOCKS := socks5.NewServer(socks5.WithDial(func(ctx context.Context, network, addr string) (net.Conn, error) {
		socksDials.Add(1)
		var d net.Dialer
		return d.DialContext(ctx, network, addr)
	}))
	uln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go upSOCKS.Serve(uln)
	t.Cleanup(func() { uln.Close() })
	var connectDials atomic.Int64
	upHTTP := plainOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodConnect {
			http.Error(rw, "CONNECT only", http.StatusMethodNotAllowed)
			return
		}
		connectDials.Add(1)
		up, err := net.Dial("tcp", r.Host)
		if err != nil {
			http.Error(rw, err.Error(), http.StatusBadGateway)
			return
		}
		defer up.Close()
		c, brw, _ := rw.(http.Hijacker).Hijack()
		defer c.Close()
		io.WriteString(c, "HTTP/1.1 200 OK\r\n\r\n")
		go func() {
			io.Copy(up, brw)
			up.(*net.TCPConn).CloseWrite()
		}()
		io.Copy(c, up)
	}))
	for _, tc := range []struct {
		name, url string
		dials     *atomic.Int64
		// halfClose: the client's EOF reaches the echo server, whose tail
		// then comes back.
		halfClose bool
	}{
		{"socks5 upstream", "socks5://" + uln.Addr().String(), &socksDials, true},
		{"connect upstream", upHTTP.URL, &connectDials, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, worldOpts{
				upstream: upstream.Config{URL: tc.url},
				socks5:   socksOn(socks.Config{AllowNoAuth: true}),
			})
			before := tc.dials.Load()
			c := socksTunnelTCP(t, w, echo)
			data := append([]byte{0}, bytes.Repeat([]byte("through the upstream "), 1000)...)
			go func() {
				c.Write(data)
				c.CloseWrite()
			}()
			_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
			want := append(data, "TAIL"...)
			if !tc.halfClose {
				want = data
			}
			got := make([]byte, len(want))
			if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, want) {
				t.Fatalf("got %d bytes, %v", len(got), err)
			}
			if tc.halfClose {
				if n, err := c.Read(make([]byte, 1)); n != 0 || err != io.EOF {
					t.Fatalf("after the tail: %d, %v; want EOF", n, err)
				}
			}
			if n := tc.dials.Load() - before; n != 1 {
				t.Fatalf("upstream proxy opened %d tunnels, want 1", n)
			}
		})
	}
}

// countingLookup is the upstream's resolver seam: it counts every lookup
// of an origin's name and answers none.
type countingLookup struct {
	mu    sync.Mutex
	names []string
}

func (l *countingLookup) lookup(_ context.Context, _, host string) ([]netip.Addr, error) {
	l.mu.Lock()
	l.names = append(l.names, host)
	l.mu.Unlock()
	return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
}

func (l *countingLookup) looked() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.names...)
}

// TestSOCKS5RefusesForbiddenTargetsBeforeLookup: the SSRF guard's early
// check runs on every SOCKS5 path, as on the HTTP port: a loopback target
// in any spelling gets reply 0x02 (not allowed by ruleset) on an
// intercepted port (before the success reply, not after it), on another
// port and for a bypass host, and nothing is dialled or looked up. A
// permitted name is looked up through the same seam (it fails here: 0x04),
// which shows the seam is on the path.
func TestSOCKS5RefusesForbiddenTargetsBeforeLookup(t *testing.T) {
	lookups := &countingLookup{}
	rec := &recordingUpstream{}
	w := newWorld(t, worldOpts{
		proxy:        proxy.Config{BypassHosts: []string{"bypassed.localhost"}},
		upstreamOpts: []upstream.Option{upstream.WithLookup(lookups.lookup)},
		guard:        &netguard.Config{},
		socks5:       socksOn(socks.Config{AllowNoAuth: true, MITMPorts: []int{443}, SniffTimeout: 100 * time.Millisecond}),
		wrapUpstream: rec.wrap,
	})
	for _, port := range []int{443, 9999} {
		for _, host := range []string{"0x7f.1", "2130706433", "127.1", "localhost.", "foo.localhost",
			"bypassed.localhost", "127.0.0.1"} {
			t.Run(fmt.Sprintf("%s:%d", host, port), func(t *testing.T) {
				r := dialRaw(t, w)
				if got := r.greet(0); !bytes.Equal(got, []byte{5, 0}) {
					t.Fatalf("greet % x", got)
				}
				if got := r.request(1, host, port); got != 2 {
					t.Fatalf("reply %d, want 2 (connection not allowed by ruleset)", got)
				}
				r.expectClosed()
			})
		}
	}
	if got := lookups.looked(); len(got) != 0 {
		t.Errorf("refused targets were looked up: %q", got)
	}
	if dials, _ := rec.recorded(); len(dials) != 0 {
		t.Errorf("refused targets were dialled: %q", dials)
	}
	if n := w.ca.Stats().Mints; n != 0 {
		t.Errorf("%d certificates minted for refused targets", n)
	}

	// The control: a name the guard lets through is looked up, through the
	// counted seam, on both kinds of port.
	r := dialRaw(t, w)
	r.greet(0)
	if got := r.request(1, "public.test", 9999); got != 4 {
		t.Fatalf("permitted name on another port: reply %d, want 4 (its lookup fails)", got)
	}
	r = dialRaw(t, w)
	r.greet(0)
	if got := r.request(1, "public.test", 443); got != 0 {
		t.Fatalf("permitted name on a MITM port: reply %d, want 0", got)
	}
	r.expectClosed() // silent client: dialled after the sniff timeout, and the lookup fails
	if got := lookups.looked(); len(got) != 2 || got[0] != "public.test" || got[1] != "public.test" {
		t.Fatalf("lookups %q, want public.test twice", got)
	}
}
