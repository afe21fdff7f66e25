package proxy_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/logbuf"
	"github.com/seed-a3c387e8/onceproxy/internal/metrics"
	"github.com/seed-a3c387e8/onceproxy/mitm"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/ratelimit"
	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// world is one running proxy with its CA, wired like main.go does it, plus
// helpers to reach it. Fields are filled by newWorld.
type world struct {
	t        testing.TB
	ca       *mitm.Authority
	caPool   *x509.CertPool // trusts only onceproxy's CA
	caFile   string         // ca.pem path, for curl
	up       *upstream.Pool
	srv      *proxy.Server
	engine   *dedup.Engine // nil unless worldOpts.dedup
	proxyURL *url.URL
	logs     *logbuf.Buffer
	// socksAddr is the SOCKS5 port (host:port) when worldOpts.socks5 is set.
	socksAddr string
}

type worldOpts struct {
	proxy    proxy.Config
	upstream upstream.Config
	// upstreamOpts are passed to upstream.New (a counting lookup, say).
	upstreamOpts []upstream.Option
	next         func(up http.RoundTripper) http.RoundTripper // wraps the upstream as Options.Next
	// originCAs are trusted for origins (written to files for upstream.ca_files).
	originCAs []*x509.Certificate
	// dedup, when set, puts a dedup engine (memory store) in front of the
	// upstream, as main.go does.
	dedup *dedup.Config
	// quiet discards logs (benchmarks: the buffer would grow without bound).
	quiet bool
	// socks5, when set, also serves SOCKS5 on a loopback port (world.socksAddr).
	socks5 *socks.Config
	// users is Options.Users.
	users proxy.UserStore
	// wrapUpstream wraps Options.Upstream (blind tunnels), e.g. to record dials.
	wrapUpstream func(proxy.Upstream) proxy.Upstream
	// limiter, guard and metrics are the Options of the same names.
	limiter *ratelimit.Limiter
	guard   proxy.TargetGuard
	metrics *metrics.Metrics
}

func newWorld(t testing.TB, o worldOpts) *world {
	t.Helper()
	dir := t.TempDir()
	logs := &logbuf.Buffer{}
	var logOut io.Writer = logs
	if o.quiet {
		logOut = io.Discard
	}
	logger := slog.New(slog.NewTextHandler(logOut, &slog.HandlerOptions{Level: slog.LevelDebug}))

	ca, err := mitm.LoadOrCreate(mitm.Config{CADir: filepath.Join(dir, "certs")}, logger)
	if err != nil {
		t.Fatalf("LoadOrCreate: %v", err)
	}
	t.Cleanup(ca.Close)

	for i, c := range o.originCAs {
		f := filepath.Join(dir, "origin-ca-"+string(rune('a'+i))+".pem")
		if err := os.WriteFile(f, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw}), 0o644); err != nil {
			t.Fatal(err)
		}
		o.upstream.CAFiles = append(o.upstream.CAFiles, f)
	}
	up, err := upstream.New(o.upstream, logger, o.upstreamOpts...)
	if err != nil {
		t.Fatalf("upstream.New: %v", err)
	}
	t.Cleanup(up.Close)

	opts := proxy.Options{Logger: logger, Certs: ca, Upstream: up, AccessLog: true, Users: o.users,
		Limiter: o.limiter, Guard: o.guard, Metrics: o.metrics}
	if o.wrapUpstream != nil {
		opts.Upstream = o.wrapUpstream(up)
	}
	var engine *dedup.Engine
	if o.dedup != nil {
		cfg := o.dedup.WithDefaults()
		store := dedup.NewMemoryStore(int64(cfg.Memory.MaxBytes))
		t.Cleanup(store.Close)
		engine, err = dedup.New(cfg, dedup.Options{Store: store, Next: up, Logger: logger})
		if err != nil {
			t.Fatalf("dedup.New: %v", err)
		}
		t.Cleanup(engine.Close)
		opts.Next = engine
	}
	if o.next != nil {
		opts.Next = o.next(up)
	}
	if o.proxy.Listen == "" {
		o.proxy.Listen = "127.0.0.1:0"
	}
	if o.proxy.ReadHeaderTimeout == 0 {
		// Hundreds of TLS handshakes on two cores under -race can delay a
		// client's first request past the production 10s; the tests that
		// are about the header timeout set their own.
		o.proxy.ReadHeaderTimeout = time.Minute
	}
	srv, err := proxy.New(o.proxy, opts)
	if err != nil {
		t.Fatalf("proxy.New: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	var socksAddr string
	var socksServed chan error
	if o.socks5 != nil {
		sln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		socksAddr = sln.Addr().String()
		socksServed = make(chan error, 1)
		go func() { socksServed <- srv.ServeSOCKS5(sln, *o.socks5) }()
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
		if socksServed != nil {
			if err := <-socksServed; err != nil {
				t.Errorf("ServeSOCKS5: %v", err)
			}
		}
		if t.Failed() {
			t.Logf("proxy log:\n%s", logs.String())
		}
	})

	pool := x509.NewCertPool()
	pool.AddCert(ca.Certificate())
	w := &world{
		t:        t,
		ca:       ca,
		caPool:   pool,
		caFile:   ca.CertPath(),
		up:       up,
		srv:      srv,
		engine:   engine,
		proxyURL: &url.URL{Scheme: "http", Host: ln.Addr().String()},
		logs:     logs,
	}
	w.socksAddr = socksAddr
	return w
}

// client returns an http.Client that uses the proxy explicitly (never the
// environment) and trusts only onceproxy's CA. h2 asks for HTTP/2 inside
// the MITM tunnel.
func (w *world) client(h2 bool) *http.Client {
	tr := &http.Transport{
		Proxy:              http.ProxyURL(w.proxyURL),
		TLSClientConfig:    &tls.Config{RootCAs: w.caPool},
		ForceAttemptHTTP2:  h2,
		DisableCompression: true,
	}
	if !h2 {
		tr.TLSClientConfig.NextProtos = []string{"http/1.1"}
		tr.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	}
	w.t.Cleanup(tr.CloseIdleConnections)
	// Generous: 500 clients' TLS handshakes under -race on a loaded CI
	// host take a while; a hang still fails the test.
	return &http.Client{Transport: tr, Timeout: time.Minute}
}

// get fetches u through the proxy and returns the response with its body read.
func (w *world) get(c *http.Client, u string, hdr ...string) (*http.Response, string) {
	w.t.Helper()
	req, err := http.NewRequest(http.MethodGet, u, nil)
	if err != nil {
		w.t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Add(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		w.t.Fatalf("GET %s: %v", u, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		w.t.Fatalf("GET %s: read body: %v", u, err)
	}
	return resp, string(b)
}

// tlsOrigin starts an HTTPS origin (HTTP/2 enabled unless h1Only) on loopback.
func tlsOrigin(t testing.TB, h http.Handler, h1Only bool) *httptest.Server {
	t.Helper()
	s := httptest.NewUnstartedServer(h)
	s.EnableHTTP2 = !h1Only
	s.StartTLS()
	t.Cleanup(s.Close)
	return s
}

func plainOrigin(t testing.TB, h http.Handler) *httptest.Server {
	t.Helper()
	s := httptest.NewServer(h)
	t.Cleanup(s.Close)
	return s
}

// untrustedTLSOrigin starts an HTTPS origin with a fresh self-signed
// certificate that nothing trusts (httptest servers all share one built-in
// certificate, so trusting one trusts them all).
func untrustedTLSOrigin(t testing.TB, h http.Handler) *httptest.Server {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(42),
		Subject:      pkix.Name{CommonName: "untrusted origin"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	s := httptest.NewUnstartedServer(h)
	s.TLS = &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}
	s.StartTLS()
	t.Cleanup(s.Close)
	return s
}
