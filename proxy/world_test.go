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
	"strconv"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/app"
	"github.com/seed-a3c387e8/onceproxy/internal/logbuf"
	"github.com/seed-a3c387e8/onceproxy/internal/netguard"
	"github.com/seed-a3c387e8/onceproxy/mitm"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/auth"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/ratelimit"
	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// world is one running onceproxy, built by app.Build from a configuration
// exactly as the program builds itself, plus helpers to reach it. Fields
// are filled by newWorld.
type world struct {
	t        testing.TB
	app      *app.App
	ca       *mitm.Authority
	caPool   *x509.CertPool // trusts only onceproxy's CA
	caFile   string         // ca.pem path, for curl
	up       *upstream.Pool
	srv      *proxy.Server
	engine   *dedup.Engine
	proxyURL *url.URL
	logs     *logbuf.Buffer
	// socksAddr is the SOCKS5 port (host:port) when worldOpts.socks5 is set.
	socksAddr string
}

// worldOpts are the configuration sections a test sets (the rest is the
// shipped config.yaml) and the app's test seams.
type worldOpts struct {
	proxy    proxy.Config
	upstream upstream.Config
	// originCAs are trusted for origins (written to files for upstream.ca_files).
	originCAs []*x509.Certificate
	// dedup, when set, is the dedup section (dedupOn); nil turns dedup off.
	dedup *dedup.Config
	// socks5, when set, also serves SOCKS5 on a loopback port (world.socksAddr).
	socks5 *socks.Config
	// users are auth.users: name → password.
	users map[string]string
	// authFailures, when set, is auth.max_failures_per_minute.
	authFailures int
	// rateLimit and guard, when set, are those sections; the shipped guard
	// lets the proxy reach loopback, where the test origins live.
	rateLimit *ratelimit.Config
	guard     *netguard.Config
	// quiet discards logs (benchmarks: the buffer would grow without bound).
	quiet bool
	// reloaded, when set, changes the configuration a reload
	// (world.app.Reload) reads: a copy of the one the world started with.
	reloaded func(*app.Config)
	// The seams of app.Options.
	upstreamOpts []upstream.Option
	next         func(http.RoundTripper) http.RoundTripper
	wrapUpstream func(proxy.Upstream) proxy.Upstream
}

// shippedConfig is config.yaml, the defaults the program starts from.
var shippedConfig = func() []byte {
	b, err := os.ReadFile("../config.yaml")
	if err != nil {
		panic(err)
	}
	return b
}()

func newWorld(t testing.TB, o worldOpts) *world {
	t.Helper()
	dir := t.TempDir()
	logs := &logbuf.Buffer{}
	var logOut io.Writer = logs
	if o.quiet {
		logOut = io.Discard
	}
	logger := slog.New(slog.NewTextHandler(logOut, &slog.HandlerOptions{Level: slog.LevelDebug}))

	cfg, err := app.LoadConfig(shippedConfig, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Log.Access = true
	cfg.Admin.Listen = ""
	cfg.MITM.CADir = filepath.Join(dir, "certs")
	cfg.Proxy = o.proxy
	if cfg.Proxy.Listen == "" {
		cfg.Proxy.Listen = "127.0.0.1:0"
	}
	if cfg.Proxy.ReadHeaderTimeout == 0 {
		// Hundreds of TLS handshakes on two cores under -race can delay a
		// client's first request past the production 10s; the tests that
		// are about the header timeout set their own.
		cfg.Proxy.ReadHeaderTimeout = time.Minute
	}
	if cfg.Proxy.ShutdownGrace == 0 {
		// Past net/http's own wait for a connection that has sent nothing
		// yet (StateNew counts as busy until it is over 5 whole seconds
		// old, up to 6s): a spare tunnel a client opened just before the
		// end (an HTTP/2 client racing dials) held a 5s grace to the
		// last second and failed TestStampedeH2 in CI with nothing in
		// flight.
		cfg.Proxy.ShutdownGrace = 10 * time.Second
	}
	cfg.SOCKS5.Listen = ""
	if o.socks5 != nil {
		cfg.SOCKS5 = *o.socks5
		cfg.SOCKS5.Listen = "127.0.0.1:0"
	}
	cfg.Upstream = o.upstream
	for i, c := range o.originCAs {
		f := filepath.Join(dir, "origin-ca-"+string(rune('a'+i))+".pem")
		if err := os.WriteFile(f, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw}), 0o644); err != nil {
			t.Fatal(err)
		}
		cfg.Upstream.CAFiles = append(cfg.Upstream.CAFiles, f)
	}
	cfg.Dedup.Enabled = false
	if o.dedup != nil {
		cfg.Dedup = *o.dedup
	}
	env := map[string]string{}
	for name, pw := range o.users {
		v := "PW_" + strconv.Itoa(len(env))
		env[v] = pw
		cfg.Auth.Users = append(cfg.Auth.Users, auth.UserConfig{Name: name, PasswordEnv: v})
	}
	if o.authFailures != 0 {
		cfg.Auth.MaxFailuresPerMinute = o.authFailures
	}
	if o.rateLimit != nil {
		cfg.RateLimit = *o.rateLimit
	}
	if o.guard != nil {
		cfg.Guard = *o.guard
	}
	var load func() (*app.Config, error)
	if o.reloaded != nil {
		load = func() (*app.Config, error) {
			next := *cfg
			o.reloaded(&next)
			return &next, nil
		}
	}
	a, err := app.Build(cfg, app.Options{
		Load:            load,
		Logger:          logger,
		Getenv:          func(k string) string { return env[k] },
		UpstreamOptions: o.upstreamOpts,
		WrapNext:        o.next,
		WrapUpstream:    o.wrapUpstream,
	})
	if err != nil {
		t.Fatalf("app.Build: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- a.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
		if t.Failed() {
			t.Logf("proxy log:\n%s", logs.String())
		}
	})

	pool := x509.NewCertPool()
	pool.AddCert(a.CA.Certificate())
	w := &world{
		t:        t,
		app:      a,
		ca:       a.CA,
		caPool:   pool,
		caFile:   a.CA.CertPath(),
		up:       a.Upstream,
		srv:      a.Proxy,
		engine:   a.Engine,
		proxyURL: &url.URL{Scheme: "http", Host: a.Addrs().Proxy},
		logs:     logs,
	}
	if o.socks5 != nil {
		w.socksAddr = a.Addrs().SOCKS5
	}
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
	cert, _ := selfSignedCert(t, "untrusted origin")
	s := httptest.NewUnstartedServer(h)
	s.TLS = &tls.Config{Certificates: []tls.Certificate{cert}}
	s.StartTLS()
	t.Cleanup(s.Close)
	return s
}

// selfSignedCert makes a fresh self-signed server certificate for
// 127.0.0.1 and localhost, named name, and returns it with its parsed
// leaf, for a test origin's TLS and the pool that trusts it.
func selfSignedCert(t testing.TB, name string) (tls.Certificate, *x509.Certificate) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(42),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:     []string{"localhost"},
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, leaf
}
