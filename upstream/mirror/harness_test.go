package mirror_test

import (
	"bufio"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/capture"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/fporigin"
	"github.com/seed-a3c387e8/onceproxy/mitm"
	"github.com/seed-a3c387e8/onceproxy/upstream/mirror"
)

// harness is the smallest MITM proxy that mirrors its clients: it accepts
// CONNECT, reads the client's hello, terminates TLS with onceproxy's
// certificate authority, taps the decrypted connection under an
// http.Server, and sends each request to the origin over a connection
// opened with the client's fingerprint, pooled per fingerprint. It is what
// the proxy's MITM path and upstream pool do once they are wired to
// packages capture and mirror.
type harness struct {
	t      *testing.T
	ln     net.Listener
	auth   *mitm.Authority
	origin *fporigin.Origin
	dialer *mirror.Dialer
	inner  *http.Server
	conns  chan net.Conn
	done   chan struct{}
	wg     sync.WaitGroup

	mu      sync.Mutex
	pool    map[poolKey][]mirror.ClientConn
	reports []mirror.Report
	served  []string // the paths of the requests it forwarded
}

type poolKey struct {
	fp     fingerprint.ID
	target string
}

// tunnelConn is a tapped client connection and the CONNECT target.
type tunnelConn struct {
	*capture.Conn
	target string
}

type tunnelKey struct{}

func startHarness(t *testing.T, origin *fporigin.Origin) *harness {
	t.Helper()
	auth, err := mitm.LoadOrCreate(mitm.Config{CADir: t.TempDir()}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{
		t: t, ln: ln, auth: auth, origin: origin,
		conns: make(chan net.Conn), done: make(chan struct{}),
		pool: make(map[poolKey][]mirror.ClientConn),
	}
	h.dialer = &mirror.Dialer{
		// Every target is the origin: the clients ask for localhost or
		// origin.test.
		Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, origin.Addr())
		},
		TLSConfig: &tls.Config{RootCAs: origin.CertPool()},
	}
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetHTTP2(true)
	protocols.SetUnencryptedHTTP2(true) // a tapped connection is not a *tls.Conn
	h.inner = &http.Server{
		Handler:   http.HandlerFunc(h.serve),
		Protocols: &protocols,
		ErrorLog:  log.New(io.Discard, "", 0),
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return context.WithValue(ctx, tunnelKey{}, c.(*tunnelConn))
		},
	}
	h.wg.Add(2)
	go func() {
		defer h.wg.Done()
		h.inner.Serve(h)
	}()
	go func() {
		defer h.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			h.wg.Add(1)
			go func() {
				defer h.wg.Done()
				h.tunnel(c)
			}()
		}
	}()
	t.Cleanup(h.close)
	return h
}

// The harness is the inner server's listener.
func (h *harness) Accept() (net.Conn, error) {
	select {
	case c := <-h.conns:
		return c, nil
	case <-h.done:
		return nil, net.ErrClosed
	}
}
func (h *harness) Close() error   { return nil }
func (h *harness) Addr() net.Addr { return h.ln.Addr() }

func (h *harness) close() {
	h.ln.Close()
	close(h.done)
	h.inner.Close()
	h.wg.Wait()
	h.mu.Lock()
	for _, ccs := range h.pool {
		for _, cc := range ccs {
			cc.Close()
		}
	}
	h.mu.Unlock()
	h.auth.Close()
}

// tunnel answers a CONNECT and hands the decrypted connection on.
func (h *harness) tunnel(c net.Conn) {
	c.SetDeadline(time.Now().Add(30 * time.Second))
	br := bufio.NewReader(c)
	req, err := http.ReadRequest(br)
	if err != nil || req.Method != http.MethodConnect || br.Buffered() > 0 {
		c.Close()
		return
	}
	io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n")
	rc, hello, err := capture.PeekClientHello(c)
	if err != nil {
		h.t.Logf("harness: %v (the connection goes on without a fingerprint)", err)
	}
	cfg := h.auth.ServerConfig(req.Host).Clone()
	cfg.NextProtos = []string{"h2", "http/1.1"}
	cfg.SessionTicketsDisabled = true // no resumption: the hello stays a first one
	tc := tls.Server(rc, cfg)
	if err := tc.Handshake(); err != nil {
		c.Close()
		return
	}
	c.SetDeadline(time.Time{})
	select {
	case h.conns <- &tunnelConn{Conn: capture.NewConn(tc, hello), target: req.Host}:
	case <-h.done:
		c.Close()
	}
}

// hopByHop are the fields that end at the proxy (RFC 9110 §7.6.1).
var hopByHop = map[string]bool{
	"Connection": true, "Proxy-Connection": true, "Keep-Alive": true, "Te": true, "Trailer": true,
	"Transfer-Encoding": true, "Upgrade": true, "Proxy-Authorization": true, "Proxy-Authenticate": true,
}

func (h *harness) serve(w http.ResponseWriter, r *http.Request) {
	tun := r.Context().Value(tunnelKey{}).(*tunnelConn)
	h.mu.Lock()
	h.served = append(h.served, r.URL.Path)
	h.mu.Unlock()
	shape := tun.Shape(r)
	fp := tun.Fingerprint()
	out := r.Clone(fingerprint.WithShape(r.Context(), shape))
	out.RequestURI = ""
	out.URL.Scheme, out.URL.Host = "https", tun.target
	for k := range out.Header {
		if hopByHop[k] {
			delete(out.Header, k)
		}
	}
	// An HTTP/1.1 client's "Connection: keep-alive" means the same on the
	// origin connection, and the origin sees it where the client put it.
	if r.ProtoMajor == 1 && strings.EqualFold(r.Header.Get("Connection"), "keep-alive") {
		out.Header.Set("Connection", "keep-alive")
	}
	if r.ContentLength == 0 {
		out.Body = nil
	}
	cc, err := h.conn(r.Context(), fp, tun.target)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	resp, err := cc.RoundTrip(out)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	for k, vs := range resp.Header {
		if !hopByHop[k] {
			w.Header()[k] = vs
		}
	}
	w.WriteHeader(resp.StatusCode)
	io.Copy(w, resp.Body)
}

// conn returns a pooled connection for the fingerprint, or opens one.
func (h *harness) conn(ctx context.Context, fp *fingerprint.Fingerprint, target string) (mirror.ClientConn, error) {
	key := poolKey{target: target}
	var hello *fingerprint.ClientHello
	var pre *fingerprint.H2
	if fp != nil {
		key.fp, hello, pre = fp.ID(), fp.Hello, fp.H2
	}
	h.mu.Lock()
	for _, cc := range h.pool[key] {
		if cc.CanTakeRequest() {
			h.mu.Unlock()
			return cc, nil
		}
	}
	h.mu.Unlock()
	c, err := h.dialer.DialTLS(ctx, "tcp", target, hello) // verified for target's host
	if err != nil {
		return nil, err
	}
	cc, err := mirror.NewClientConn(c, c.ConnectionState().NegotiatedProtocol, pre, mirror.Options{})
	if err != nil {
		c.Close()
		return nil, err
	}
	h.mu.Lock()
	h.pool[key] = append(h.pool[key], cc)
	h.reports = append(h.reports, c.Report())
	h.mu.Unlock()
	return cc, nil
}

func (h *harness) Served(path string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Contains(h.served, path)
}

func (h *harness) Reports() []mirror.Report {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]mirror.Report(nil), h.reports...)
}

// spki is the base64 SHA-256 of the harness CA's public key, for
// Chromium's --ignore-certificate-errors-spki-list.
func (h *harness) spki() string {
	sum := sha256.Sum256(h.auth.Certificate().RawSubjectPublicKeyInfo)
	return base64.StdEncoding.EncodeToString(sum[:])
}

var errNoRecord = errors.New("no record for the path")

// recordFor returns the origin's record of the request for path.
func recordFor(t *testing.T, o *fporigin.Origin, path string) (fporigin.Record, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for n := 1; ; n++ {
		recs, err := o.Wait(ctx, n)
		for _, r := range recs {
			if r.Path == path {
				return r, nil
			}
		}
		if err != nil {
			return fporigin.Record{}, errNoRecord
		}
	}
}
