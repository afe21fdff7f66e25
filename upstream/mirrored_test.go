package upstream_test

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/capture"
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

// withTimeout is a request context for one test request.
func withTimeout(t *testing.T, info clientinfo.Info) context.Context {
	ctx, cancel := context.WithTimeout(clientinfo.With(context.Background(), info), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}
