package upstream_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	socks5 "github.com/things-go/go-socks5"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func echo(w http.ResponseWriter, r *http.Request) {
	fmt.Fprintf(w, "ok %s", r.URL.Path)
}

// originCAFile writes the httptest TLS certificate to a PEM file.
func originCAFile(t *testing.T, s *httptest.Server) string {
	t.Helper()
	f := filepath.Join(t.TempDir(), "origin.pem")
	b := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: s.Certificate().Raw})
	if err := os.WriteFile(f, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return f
}

// httpGateway is a minimal authenticating HTTP proxy (CONNECT and
// absolute-form), standing in for a provider gateway.
type httpGateway struct {
	user, pass string
	connects   atomic.Int64
	forwards   atomic.Int64
	lastAuth   atomic.Value
	srv        *httptest.Server
}

func startHTTPGateway(t *testing.T, user, pass string) *httpGateway {
	g := &httpGateway{user: user, pass: pass}
	g.srv = httptest.NewServer(http.HandlerFunc(g.serve))
	t.Cleanup(g.srv.Close)
	return g
}

func (g *httpGateway) serve(w http.ResponseWriter, r *http.Request) {
	auth := r.Header.Get("Proxy-Authorization")
	g.lastAuth.Store(auth)
	want := "Basic " + base64.StdEncoding.EncodeToString([]byte(g.user+":"+g.pass))
	if auth != want {
		w.Header().Set("Proxy-Authenticate", `Basic realm="gw"`)
		http.Error(w, "bad gateway credentials", http.StatusProxyAuthRequired)
		return
	}
	if r.Method == http.MethodConnect {
		g.connects.Add(1)
		target, err := net.Dial("tcp", r.Host)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusOK)
		client, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			target.Close()
			return
		}
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); io.Copy(target, brw); target.(*net.TCPConn).CloseWrite() }()
		go func() { defer wg.Done(); io.Copy(client, target); client.Close() }()
		wg.Wait()
		target.Close()
		return
	}
	g.forwards.Add(1)
	r.RequestURI = ""
	r.Header.Del("Proxy-Authorization")
	resp, err := (&http.Transport{}).RoundTrip(r)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	for k, v := range resp.Header {
		w.Header()[k] = v
	}
	w.WriteHeader(resp.StatusCode)
	io.Copy(w, resp.Body)
}

// startSOCKS5 runs an authenticating SOCKS5 server (go-socks5) on loopback.
func startSOCKS5(t *testing.T, user, pass string) (addr string, conns *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	conns = new(atomic.Int64)
	srv := socks5.NewServer(
		socks5.WithCredential(socks5.StaticCredentials{user: pass}),
		socks5.WithDial(func(ctx context.Context, network, addr string) (net.Conn, error) {
			conns.Add(1)
			var d net.Dialer
			return d.DialContext(ctx, network, addr)
		}),
	)
	go srv.Serve(ln)
	t.Cleanup(func() { ln.Close() })
	return ln.Addr().String(), conns
}

func get(t *testing.T, rt http.RoundTripper, u string) (*http.Response, string, error) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, u, nil)
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp, string(b), err
}

func TestDirectVerifiesOrigins(t *testing.T) {
	bothWays(t, testDirectVerifiesOrigins)
}

func testDirectVerifiesOrigins(t *testing.T, c client) {
	origin := httptest.NewTLSServer(http.HandlerFunc(echo))
	defer origin.Close()

	f, err := upstream.New(upstream.Config{}, quiet)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	_, _, err = c.get(t, f, origin.URL+"/a")
	var cert *tls.CertificateVerificationError
	if err == nil || !strings.Contains(err.Error(), "certificate") || !errors.As(err, &cert) {
		t.Fatalf("untrusted origin: err = %v, want a certificate error", err)
	}

	f2, err := upstream.New(upstream.Config{CAFiles: []string{originCAFile(t, origin)}}, quiet)
	if err != nil {
		t.Fatal(err)
	}
	defer f2.Close()
	resp, body, err := c.get(t, f2, origin.URL+"/a")
	if err != nil || resp.StatusCode != 200 || body != "ok /a" {
		t.Fatalf("trusted origin: %v %v %q", err, resp, body)
	}
	c.mirrored(t, f2)
}

func TestInsecureSkipVerifyOnlyForListedHosts(t *testing.T) {
	bothWays(t, testInsecureSkipVerifyOnlyForListedHosts)
}

func testInsecureSkipVerifyOnlyForListedHosts(t *testing.T, c client) {
	origin := httptest.NewTLSServer(http.HandlerFunc(echo))
	defer origin.Close()
	_, port, _ := net.SplitHostPort(origin.Listener.Addr().String())

	f, err := upstream.New(upstream.Config{InsecureSkipVerifyHosts: []string{"localhost"}}, quiet)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// The httptest certificate names 127.0.0.1 and example.com: reaching
	// it as "localhost" is skipped (listed), as 127.0.0.1 it is verified
	// (and fails: its CA is not trusted).
	if _, _, err := c.get(t, f, "https://localhost:"+port+"/skip"); err != nil {
		t.Fatalf("listed host: %v", err)
	}
	if _, _, err := c.get(t, f, "https://127.0.0.1:"+port+"/verify"); err == nil {
		t.Fatal("unlisted host: verification was skipped")
	}
	c.mirrored(t, f)
}

func TestThroughHTTPUpstream(t *testing.T) {
	tlsO := httptest.NewTLSServer(http.HandlerFunc(echo))
	defer tlsO.Close()
	plainO := httptest.NewServer(http.HandlerFunc(echo))
	defer plainO.Close()
	gw := startHTTPGateway(t, "user-session-a", "s3cret")
	gwURL := "http://user-session-a:s3cret@" + gw.srv.Listener.Addr().String()

	f, err := upstream.New(upstream.Config{URL: gwURL, CAFiles: []string{originCAFile(t, tlsO)}}, quiet)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if got := f.Describe(); strings.Contains(got, "s3cret") {
		t.Errorf("Describe leaks the password: %q", got)
	}
	if _, body, err := get(t, f, tlsO.URL+"/tls"); err != nil || body != "ok /tls" {
		t.Fatalf("https via gateway: %v %q", err, body)
	}
	if gw.connects.Load() != 1 {
		t.Errorf("gateway CONNECTs = %d, want 1", gw.connects.Load())
	}
	if _, body, err := get(t, f, plainO.URL+"/plain"); err != nil || body != "ok /plain" {
		t.Fatalf("http via gateway: %v %q", err, body)
	}
	if gw.forwards.Load() != 1 {
		t.Errorf("gateway absolute-form forwards = %d, want 1", gw.forwards.Load())
	}
	// A blind tunnel goes through the gateway too.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := f.DialContext(ctx, "tcp", plainO.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(c, "GET /tunnel HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	c.Close()
	if string(b) != "ok /tunnel" || gw.connects.Load() != 2 {
		t.Fatalf("tunnel: %q, connects %d", b, gw.connects.Load())
	}
}

func TestHTTPUpstreamWrongCredentials(t *testing.T) {
	tlsO := httptest.NewTLSServer(http.HandlerFunc(echo))
	defer tlsO.Close()
	gw := startHTTPGateway(t, "u", "right")
	f, err := upstream.New(upstream.Config{URL: "http://u:wrong@" + gw.srv.Listener.Addr().String()}, quiet)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = f.DialContext(ctx, "tcp", tlsO.Listener.Addr().String())
	var de *upstream.DialError
	if !errors.As(err, &de) || !strings.Contains(err.Error(), "407") || strings.Contains(err.Error(), "wrong") {
		t.Fatalf("err = %v; want a DialError naming 407 and not the password", err)
	}
	if _, _, err := get(t, f, tlsO.URL+"/x"); err == nil {
		t.Fatal("request through a gateway that refused us succeeded")
	}
}

func TestThroughSOCKS5Upstream(t *testing.T) {
	tlsO := httptest.NewTLSServer(http.HandlerFunc(echo))
	defer tlsO.Close()
	plainO := httptest.NewServer(http.HandlerFunc(echo))
	defer plainO.Close()
	addr, conns := startSOCKS5(t, "sockuser", "sockpass")

	f, err := upstream.New(upstream.Config{
		URL:     "socks5://sockuser:sockpass@" + addr,
		CAFiles: []string{originCAFile(t, tlsO)},
	}, quiet)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, u := range []string{tlsO.URL + "/s", plainO.URL + "/s"} {
		if _, body, err := get(t, f, u); err != nil || body != "ok /s" {
			t.Fatalf("%s via socks5: %v %q", u, err, body)
		}
	}
	if conns.Load() != 2 {
		t.Errorf("socks5 server dialed %d targets, want 2", conns.Load())
	}

	bad, err := upstream.New(upstream.Config{URL: "socks5://sockuser:nope@" + addr}, quiet)
	if err != nil {
		t.Fatal(err)
	}
	defer bad.Close()
	if _, _, err := get(t, bad, plainO.URL+"/s"); err == nil {
		t.Fatal("socks5 with a wrong password succeeded")
	}
}

func TestDeadUpstreamIsADialError(t *testing.T) {
	dead := testkit.DeadAddr(t)
	for _, u := range []string{"http://u:p@" + dead, "socks5://u:p@" + dead} {
		f, err := upstream.New(upstream.Config{URL: u}, quiet)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err = f.DialContext(ctx, "tcp", "127.0.0.1:9")
		cancel()
		f.Close()
		var de *upstream.DialError
		if !errors.As(err, &de) {
			t.Errorf("%s: err = %v, want *DialError", u, err)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  upstream.Config
		want []string
	}{
		{"ok direct", upstream.Config{}, nil},
		{"ok http", upstream.Config{URL: "http://u:p@gw.example:8000"}, nil},
		{"ok idle per origin under the default total", upstream.Config{MaxIdleConnsPerHost: 600}, nil},
		{"ok socks5h", upstream.Config{URL: "socks5h://gw.example:1080"}, nil},
		{"bad scheme", upstream.Config{URL: "ftp://gw:21"}, []string{"url:", "scheme"}},
		{"no port", upstream.Config{URL: "http://u:secret@gw.example"}, []string{"url:", "missing port"}},
		{"many", upstream.Config{
			DialTimeout:             -1,
			MaxIdleConnsPerHost:     -2,
			CAFiles:                 []string{"/nonexistent/ca.pem"},
			InsecureSkipVerifyHosts: []string{"a/b"},
		}, []string{"dial_timeout:", "max_idle_conns_per_host:", "ca_files[0]:", "insecure_skip_verify_hosts[0]:"}},
		{"idle total negative", upstream.Config{MaxIdleConns: -1}, []string{"max_idle_conns: must not be negative"}},
		{"idle per origin over the default total", upstream.Config{MaxIdleConnsPerHost: 2000},
			[]string{"max_idle_conns_per_host: 2000 is more than max_idle_conns (1024)"}},
		{"idle per origin over the total", upstream.Config{MaxIdleConns: 10, MaxIdleConnsPerHost: 20},
			[]string{"max_idle_conns_per_host: 20 is more than max_idle_conns (10)"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate(nil)
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("no error, want %v", tc.want)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
			if strings.Contains(err.Error(), "secret") {
				t.Errorf("error leaks the password: %q", err)
			}
		})
	}
}

// TestStalledBodyIsCut: an origin that sends headers and then goes silent
// mid-body is cut after the idle timeout.
func TestStalledBodyIsCut(t *testing.T) {
	bothWays(t, testStalledBodyIsCut)
}

func testStalledBodyIsCut(t *testing.T, c client) {
	hang := make(chan struct{})
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "100")
		w.WriteHeader(200)
		io.WriteString(w, "partial")
		w.(http.Flusher).Flush()
		<-hang
	}))
	defer origin.Close()
	defer close(hang)
	f, err := upstream.New(upstream.Config{IdleTimeout: 200 * time.Millisecond}, quiet)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	req, _ := http.NewRequest(http.MethodGet, origin.URL, nil)
	resp, err := f.RoundTrip(c.request(req))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	done := make(chan error, 1)
	go func() { _, err := io.ReadAll(resp.Body); done <- err }()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("stalled body read completed without error")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("stalled body was never cut")
	}
}

var _ = tls.VersionTLS12
