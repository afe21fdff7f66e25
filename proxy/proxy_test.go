package proxy_test

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// echoProto answers with the protocol the origin saw, so a test can tell
// HTTP/1.1 from HTTP/2 on the upstream leg.
func echoProto(w http.ResponseWriter, r *http.Request) {
	fmt.Fprintf(w, "proto=%s path=%s", r.Proto, r.URL.RequestURI())
}

// TestHTTPSThroughMITM: the client's HTTP version reaches the origin when
// the origin speaks it (upstream.fingerprint: mirror, the default); with
// fingerprint: go every request goes out the net/http way, HTTP/2 where
// the origin has it.
func TestHTTPSThroughMITM(t *testing.T) {
	h2Origin := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	h1Origin := tlsOrigin(t, http.HandlerFunc(echoProto), true)
	for _, mode := range []string{upstream.FingerprintMirror, upstream.FingerprintGo} {
		w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{h2Origin.Certificate(), h1Origin.Certificate()},
			upstream: upstream.Config{Fingerprint: mode}})
		h1ToH2 := "HTTP/1.1"
		if mode == upstream.FingerprintGo {
			h1ToH2 = "HTTP/2.0"
		}
		for _, tc := range []struct {
			name        string
			clientH2    bool
			origin      string
			wantClient  int // ProtoMajor the client sees inside the MITM
			wantUpProto string
		}{
			{"h1 client, h2 origin", false, h2Origin.URL, 1, h1ToH2},
			{"h2 client, h2 origin", true, h2Origin.URL, 2, "HTTP/2.0"},
			{"h1 client, h1 origin", false, h1Origin.URL, 1, "HTTP/1.1"},
			{"h2 client, h1 origin", true, h1Origin.URL, 2, "HTTP/1.1"},
		} {
			t.Run(mode+"/"+tc.name, func(t *testing.T) {
				resp, body := w.get(w.client(tc.clientH2), tc.origin+"/x?y=1")
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("status = %d, body %q", resp.StatusCode, body)
				}
				if resp.ProtoMajor != tc.wantClient {
					t.Errorf("client proto = %s, want major %d", resp.Proto, tc.wantClient)
				}
				if want := "proto=" + tc.wantUpProto + " path=/x?y=1"; body != want {
					t.Errorf("body = %q, want %q", body, want)
				}
				chains := resp.TLS.VerifiedChains
				if len(chains) == 0 || !chains[0][len(chains[0])-1].Equal(w.ca.Certificate()) {
					t.Errorf("verified chain does not end at the onceproxy CA")
				}
			})
		}
	}
}

func TestPlainHTTP(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{})
	resp, body := w.get(w.client(false), origin.URL+"/plain")
	if resp.StatusCode != http.StatusOK || body != "proto=HTTP/1.1 path=/plain" {
		t.Fatalf("got %d %q", resp.StatusCode, body)
	}
}

// TestPlainHTTPInsideCONNECT opens a CONNECT tunnel and speaks cleartext
// HTTP/1.1 inside it, as some clients do for http:// URLs.
func TestPlainHTTPInsideCONNECT(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{})
	host := strings.TrimPrefix(origin.URL, "http://")

	conn, br := connectTunnel(t, w, host)
	defer conn.Close()
	fmt.Fprintf(conn, "GET /inside HTTP/1.1\r\nHost: %s\r\n\r\n", host)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || string(body) != "proto=HTTP/1.1 path=/inside" {
		t.Fatalf("got %d %q", resp.StatusCode, body)
	}
}

// connectTunnel sends CONNECT host through the proxy and returns the open
// tunnel after the proxy's 200.
func connectTunnel(t *testing.T, w *world, host string) (net.Conn, *bufio.Reader) {
	t.Helper()
	conn, err := net.Dial("tcp", w.proxyURL.Host)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", host, host)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		t.Fatalf("CONNECT %s: %v", host, err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("CONNECT %s: status %d", host, resp.StatusCode)
	}
	return conn, br
}

func TestWebSocketEcho(t *testing.T) {
	echo := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, err := websocket.Accept(w, r, nil)
		if err != nil {
			return
		}
		defer c.CloseNow()
		for {
			typ, msg, err := c.Read(r.Context())
			if err != nil {
				return
			}
			if err := c.Write(r.Context(), typ, append([]byte("echo:"), msg...)); err != nil {
				return
			}
		}
	})
	tlsO := tlsOrigin(t, echo, true)
	plainO := plainOrigin(t, echo)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{tlsO.Certificate()}})

	for _, tc := range []struct{ name, url string }{
		{"wss through MITM", "wss" + strings.TrimPrefix(tlsO.URL, "https")},
		{"ws plain", "ws" + strings.TrimPrefix(plainO.URL, "http")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			c, _, err := websocket.Dial(ctx, tc.url, &websocket.DialOptions{HTTPClient: w.client(false)})
			if err != nil {
				t.Fatalf("dial: %v", err)
			}
			defer c.CloseNow()
			for i := range 3 {
				msg := fmt.Sprintf("hello %d", i)
				if err := c.Write(ctx, websocket.MessageText, []byte(msg)); err != nil {
					t.Fatal(err)
				}
				_, got, err := c.Read(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if string(got) != "echo:"+msg {
					t.Fatalf("got %q", got)
				}
			}
			c.Close(websocket.StatusNormalClosure, "")
		})
	}
}

func TestCurl(t *testing.T) {
	curl, err := exec.LookPath("curl")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("curl not found; CI must install it")
		}
		t.Skip("curl not installed")
	}
	origin := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	plain := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}})
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"https http1.1", []string{"--http1.1", origin.URL + "/c"}, "HTTP/1.1 200"},
		{"https http2", []string{"--http2", origin.URL + "/c"}, "HTTP/2 200"},
		{"plain http", []string{plain.URL + "/c"}, "HTTP/1.1 200"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"-sS", "-i", "--max-time", "20", "-x", w.proxyURL.String(), "--cacert", w.caFile}, tc.args...)
			out, err := exec.Command(curl, args...).CombinedOutput()
			if err != nil {
				t.Fatalf("curl %v: %v\n%s", args, err, out)
			}
			if !strings.Contains(string(out), tc.want) || !strings.Contains(string(out), "path=/c") {
				t.Fatalf("curl output lacks %q:\n%s", tc.want, out)
			}
		})
	}
}

// TestConcurrentConnectsMintOnce opens 500 tunnels to one new host name at
// once; the CA must sign its certificate exactly once.
func TestConcurrentConnectsMintOnce(t *testing.T) {
	w := newWorld(t, worldOpts{})
	before := w.ca.Stats().Mints
	const n = 500
	var wg sync.WaitGroup
	errs := make(chan error, n)
	start := make(chan struct{})
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			errs <- handshakeThrough(w, "burst.example:443", "burst.example")
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if got := w.ca.Stats().Mints - before; got != 1 {
		t.Fatalf("minted %d certificates for one host, want 1", got)
	}
}

// handshakeThrough CONNECTs to target and completes a TLS handshake for sni,
// verifying the minted leaf against onceproxy's CA.
func handshakeThrough(w *world, target, sni string) error {
	conn, err := net.DialTimeout("tcp", w.proxyURL.Host, 10*time.Second)
	if err != nil {
		return err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", target, target)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		return fmt.Errorf("CONNECT: %w", err)
	}
	if resp.StatusCode != 200 {
		return fmt.Errorf("CONNECT: status %d", resp.StatusCode)
	}
	tc := tls.Client(conn, &tls.Config{ServerName: sni, RootCAs: w.caPool})
	if err := tc.Handshake(); err != nil {
		return fmt.Errorf("handshake: %w", err)
	}
	return nil
}

func TestBypassHostIsNotIntercepted(t *testing.T) {
	origin := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	w := newWorld(t, worldOpts{proxy: proxy.Config{BypassHosts: []string{"127.0.0.1"}}})
	// The client trusts the origin, not onceproxy: it only works if the
	// tunnel is blind.
	pool := x509.NewCertPool()
	pool.AddCert(origin.Certificate())
	c := &http.Client{Transport: &http.Transport{
		Proxy:           http.ProxyURL(w.proxyURL),
		TLSClientConfig: &tls.Config{RootCAs: pool},
	}, Timeout: 10 * time.Second}
	defer c.CloseIdleConnections()
	resp, body := w.get(c, origin.URL+"/b")
	if resp.StatusCode != 200 || !strings.Contains(body, "path=/b") {
		t.Fatalf("got %d %q", resp.StatusCode, body)
	}
	if !resp.TLS.PeerCertificates[0].Equal(origin.Certificate()) {
		t.Fatal("client did not see the origin's own certificate")
	}
	if w.ca.Stats().Mints != 0 {
		t.Fatalf("a certificate was minted for a bypass host")
	}
}

func TestUpstreamFailures(t *testing.T) {
	hang := make(chan struct{})
	t.Cleanup(func() { close(hang) })
	slow := tlsOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-hang:
		case <-r.Context().Done():
		}
	}), false)
	okOrigin := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	dead := testkit.DeadAddr(t)
	w := newWorld(t, worldOpts{
		originCAs: []*x509.Certificate{slow.Certificate(), okOrigin.Certificate()},
		upstream:  upstream.Config{ResponseHeaderTimeout: 300 * time.Millisecond},
	})
	untrusted := untrustedTLSOrigin(t, http.HandlerFunc(echoProto))

	for _, tc := range []struct {
		name, url  string
		status     int
		kind, want string
	}{
		{"origin down https", "https://" + dead + "/", 502, "upstream_error", "connection refused"},
		{"origin down plain", "http://" + dead + "/", 502, "upstream_error", "connection refused"},
		{"origin hangs", slow.URL + "/", 504, "upstream_timeout", "timeout"},
		{"origin cert untrusted", untrusted.URL + "/", 502, "upstream_tls", "certificate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, h2 := range []bool{false, true} {
				resp, body := w.get(w.client(h2), tc.url)
				if resp.StatusCode != tc.status {
					t.Fatalf("h2=%v: status %d, want %d; body %q", h2, resp.StatusCode, tc.status, body)
				}
				if got := resp.Header.Get("X-Onceproxy-Error"); got != tc.kind {
					t.Errorf("h2=%v: X-Onceproxy-Error = %q, want %q", h2, got, tc.kind)
				}
				if !strings.Contains(body, tc.want) || strings.Count(body, "\n") != 1 {
					t.Errorf("h2=%v: body %q: want one line mentioning %q", h2, body, tc.want)
				}
			}
		})
	}
	// And the proxy still serves.
	if resp, _ := w.get(w.client(false), okOrigin.URL+"/"); resp.StatusCode != 200 {
		t.Fatalf("after failures: status %d", resp.StatusCode)
	}
}

func TestMalformedRequests(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{})
	for _, tc := range []struct {
		name, raw string
		status    int
	}{
		{"garbage", "GARBAGE\r\n\r\n", 400},
		{"no host in absolute URL", "GET http:///x HTTP/1.1\r\nHost: \r\n\r\n", 400},
		{"origin-form to the proxy", "GET /x HTTP/1.1\r\nHost: example.test\r\n\r\n", 400},
		{"ftp scheme", "GET ftp://example.test/x HTTP/1.1\r\nHost: example.test\r\n\r\n", 400},
		{"CONNECT without port", "CONNECT example.test HTTP/1.1\r\nHost: example.test\r\n\r\n", 400},
		{"CONNECT bad port", "CONNECT example.test:99999 HTTP/1.1\r\nHost: example.test:99999\r\n\r\n", 400},
		{"conflicting framing", "POST " + origin.URL + "/ HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc", 400},
		{"header too large", "GET " + origin.URL + "/ HTTP/1.1\r\nHost: x\r\nX-Big: " + strings.Repeat("a", 70<<10) + "\r\n\r\n", 431},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", w.proxyURL.Host)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
			if _, err := io.WriteString(conn, tc.raw); err != nil {
				t.Fatal(err)
			}
			resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
			if err != nil {
				t.Fatalf("no HTTP response: %v", err)
			}
			body, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d (body %q)", resp.StatusCode, tc.status, body)
			}
			if len(bytes.TrimSpace(body)) == 0 {
				t.Errorf("no reason in the body")
			}
		})
	}
	if resp, body := w.get(w.client(false), origin.URL+"/still"); resp.StatusCode != 200 {
		t.Fatalf("proxy stopped serving: %d %q", resp.StatusCode, body)
	}
}

// panicky is a Next stage that panics for one path: the proxy must answer
// 500 and keep serving.
type panicky struct{ next http.RoundTripper }

func (p panicky) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.URL.Path == "/boom" {
		panic("boom")
	}
	return p.next.RoundTrip(r)
}

func TestPanicIsRecovered(t *testing.T) {
	origin := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	plain := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{
		originCAs: []*x509.Certificate{origin.Certificate()},
		next:      func(up http.RoundTripper) http.RoundTripper { return panicky{up} },
	})
	for _, base := range []string{origin.URL, plain.URL} {
		for _, h2 := range []bool{false, true} {
			c := w.client(h2)
			resp, body := w.get(c, base+"/boom")
			if resp.StatusCode != 500 || !strings.Contains(body, "internal error") {
				t.Fatalf("%s h2=%v: got %d %q", base, h2, resp.StatusCode, body)
			}
			// Same client, same (kept-alive) connection: still served.
			if resp, _ := w.get(c, base+"/fine"); resp.StatusCode != 200 {
				t.Fatalf("%s h2=%v: after panic: %d", base, h2, resp.StatusCode)
			}
		}
	}
	if !strings.Contains(w.logs.String(), "panic while serving a request") {
		t.Error("panic not logged")
	}
}

func TestAcceptEncodingPassesThrough(t *testing.T) {
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	io.WriteString(zw, strings.Repeat("compressible ", 100))
	zw.Close()
	var gotAE atomic.Value
	origin := tlsOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		gotAE.Store(r.Header.Get("Accept-Encoding"))
		w.Header().Set("Content-Encoding", "gzip")
		w.Write(gz.Bytes())
	}), false)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}})
	for _, h2 := range []bool{false, true} {
		resp, body := w.get(w.client(h2), origin.URL+"/gz", "Accept-Encoding", "gzip, br")
		if got := gotAE.Load(); got != "gzip, br" {
			t.Errorf("origin saw Accept-Encoding %q", got)
		}
		if resp.Header.Get("Content-Encoding") != "gzip" || body != gz.String() {
			t.Errorf("h2=%v: client did not get the origin's gzip bytes untouched (CE %q, %d bytes)",
				h2, resp.Header.Get("Content-Encoding"), len(body))
		}
	}
}

func TestHopByHopHeadersStripped(t *testing.T) {
	seen := make(chan http.Header, 1)
	origin := plainOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen <- r.Header.Clone()
		w.Header().Set("Connection", "X-Resp-Hop")
		w.Header().Set("X-Resp-Hop", "1")
		w.Header().Set("X-End", "kept")
	}))
	w := newWorld(t, worldOpts{})
	resp, _ := w.get(w.client(false), origin.URL+"/h",
		"Connection", "X-Hop", "X-Hop", "1", "Proxy-Connection", "keep-alive",
		"Keep-Alive", "timeout=5", "Proxy-Authorization", "Basic dTpw", "X-End", "kept")
	h := <-seen
	for _, k := range []string{"X-Hop", "Proxy-Connection", "Keep-Alive", "Proxy-Authorization"} {
		if v := h.Get(k); v != "" {
			t.Errorf("origin received hop-by-hop %s: %q", k, v)
		}
	}
	if h.Get("X-End") != "kept" {
		t.Errorf("end-to-end header lost")
	}
	if resp.Header.Get("X-Resp-Hop") != "" || resp.Header.Get("X-End") != "kept" {
		t.Errorf("response headers: %v", resp.Header)
	}
}

// TestIgnoresProcessProxyEnv: the proxy's own HTTP(S)_PROXY must not steer
// its egress.
func TestIgnoresProcessProxyEnv(t *testing.T) {
	dead := testkit.DeadAddr(t)
	t.Setenv("HTTP_PROXY", "http://"+dead)
	t.Setenv("HTTPS_PROXY", "http://"+dead)
	t.Setenv("NO_PROXY", "")
	origin := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	plain := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{
		originCAs: []*x509.Certificate{origin.Certificate()},
		proxy:     proxy.Config{BypassHosts: []string{"localhost"}},
	})
	for _, u := range []string{origin.URL, plain.URL} {
		if resp, body := w.get(w.client(false), u+"/env"); resp.StatusCode != 200 {
			t.Fatalf("%s: %d %q", u, resp.StatusCode, body)
		}
	}
}

// TestIdleTunnelIsClosed: a client that opens a tunnel and goes silent is
// cut after the idle timeout instead of holding a goroutine forever.
func TestIdleTunnelIsClosed(t *testing.T) {
	origin := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	w := newWorld(t, worldOpts{proxy: proxy.Config{IdleTimeout: 300 * time.Millisecond}})
	conn, br := connectTunnel(t, w, strings.TrimPrefix(origin.URL, "https://"))
	defer conn.Close()
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err := br.ReadByte() // we send nothing; the proxy must hang up
	if err == nil {
		t.Fatal("read a byte from a silent tunnel")
	}
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatalf("the proxy never closed the idle tunnel (our own 10s deadline fired): %v", err)
	}
}

func TestGracefulShutdownDrains(t *testing.T) {
	var release *testkit.Gate
	started := make(chan struct{}, 1)
	origin := tlsOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		if release.Wait(r.Context()) {
			io.WriteString(w, "finished")
		}
	}), false)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}})
	release = testkit.NewGate(t)
	c := w.client(false)
	type result struct {
		status int
		body   string
		err    error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := c.Get(origin.URL + "/slow")
		if err != nil {
			done <- result{err: err}
			return
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- result{resp.StatusCode, string(b), err}
	}()
	<-started
	shut := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		shut <- w.srv.Shutdown(ctx)
	}()
	// New connections are refused once shutdown began.
	testkit.Eventually(t, testkit.Patience, func() bool {
		conn, err := net.Dial("tcp", w.proxyURL.Host)
		if err != nil {
			return true
		}
		conn.Close()
		return false
	}, "the proxy to refuse new connections during shutdown")
	release.Open()
	r := <-done
	if r.err != nil || r.status != 200 || r.body != "finished" {
		t.Fatalf("in-flight request: %+v", r)
	}
	if err := <-shut; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
}

// TestShutdownClosesIdleTunnels: while a slow request drains, a keep-alive
// tunnel with nothing in flight is closed at once, not served new requests
// until the grace ends.
func TestShutdownClosesIdleTunnels(t *testing.T) {
	var release *testkit.Gate
	started := make(chan struct{}, 1)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			started <- struct{}{}
			if !release.Wait(r.Context()) {
				return
			}
		}
		io.WriteString(w, "ok")
	})
	origin := tlsOrigin(t, h, true)
	plain := plainOrigin(t, h) // a plain request keeps the proxy port's server draining
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}})
	release = testkit.NewGate(t)
	host := strings.TrimPrefix(origin.URL, "https://")

	idle := insideTunnel(t, w, host, true)
	fmt.Fprintf(idle, "GET /first HTTP/1.1\r\nHost: %s\r\n\r\n", host)
	br := bufio.NewReader(idle)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("first request: %v %v", resp, err)
	}
	io.ReadAll(resp.Body)
	resp.Body.Close()

	slow := make(chan error, 1)
	go func() {
		resp, err := w.client(false).Get(plain.URL + "/slow")
		if err == nil {
			resp.Body.Close()
		}
		slow <- err
	}()
	<-started
	shut := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		shut <- w.srv.Shutdown(ctx)
	}()
	_ = idle.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := br.ReadByte(); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("idle tunnel still open during the drain: %v", err)
	}
	release.Open()
	if err := <-slow; err != nil {
		t.Fatalf("the draining request failed: %v", err)
	}
	if err := <-shut; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
}
