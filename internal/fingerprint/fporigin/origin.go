// Package fporigin is a loopback origin for tests that records how each
// request reached it: the client's ClientHello (and its JA4 and JA3), the
// negotiated TLS version and ALPN, the HTTP version, the HTTP/2 preface
// (Akamai string) and every request's header order, with case on
// HTTP/1.1. Proxy and end-to-end tests compare what it records from a
// client directly with what it records through the proxy.
//
// It serves HTTPS (HTTP/1.1 and HTTP/2, chosen by ALPN) with a certificate
// from its own throwaway CA, or plain HTTP (HTTP/1.1, and HTTP/2 with prior
// knowledge). Give clients [Origin.CAFile], [Origin.CertPool] or, for
// Chromium, --ignore-certificate-errors-spki-list=[Origin.SPKIHash].
package fporigin

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/capture"
)

// Options configures [Start]. The zero value is an HTTPS origin on a free
// loopback port that answers "ok".
type Options struct {
	// Addr is the address to listen on. If empty, "127.0.0.1:0".
	Addr string
	// Plain serves plain HTTP instead of HTTPS.
	Plain bool
	// Hosts are the names and addresses the certificate is for, besides
	// localhost, 127.0.0.1 and ::1.
	Hosts []string
	// NextProtos is the ALPN list offered. If nil, h2 and http/1.1.
	NextProtos []string
	// Handler answers each request after it has been recorded.
	// If nil, every request gets 200 "ok".
	Handler http.Handler
	// MaxConcurrentStreams is the HTTP/2 stream limit the origin
	// announces. If zero, net/http's default (250).
	MaxConcurrentStreams int
	// Refuse, if set, fails the TLS handshake of every hello it returns an
	// error for, as a picky origin or a middlebox in front of one does.
	Refuse func(*fingerprint.ClientHello) error
}

// A Record is what the origin saw of one request.
type Record struct {
	Seq  int // 1 for the first request the origin recorded
	Conn int // the connection it came on, numbered from 1

	Method, Host, Path string
	Proto              string // "HTTP/1.1" or "HTTP/2.0"
	Header             http.Header

	TLS        bool
	TLSVersion uint16
	ALPN       string                   // negotiated; "" when none
	Hello      *fingerprint.ClientHello // nil without TLS, or when it did not parse
	JA4, JA3   string

	H2     *fingerprint.H2 // nil on HTTP/1.x
	Akamai string

	// Shape is the request's header order as sent (nil if the capture
	// lost it).
	Shape *fingerprint.Shape
}

// An Origin is a recording loopback server. Start one with [Start] and stop
// it with [Origin.Close].
type Origin struct {
	ln      net.Listener
	inner   *pushListener
	srv     *http.Server
	handler http.Handler
	refuse  func(*fingerprint.ClientHello) error
	tlsConf *tls.Config // nil when plain
	ca      *testCA
	caDir   string

	wg sync.WaitGroup // the accept loop, handshakes and Serve

	mu      sync.Mutex        // protects everything below
	raw     map[net.Conn]bool // connections still in their handshake, closed by Close
	closed  bool
	conns   int
	records []Record
	changed chan struct{} // closed and replaced when a record is added
}

// connInfo is what the origin knows about a connection before its requests.
type connInfo struct {
	id    int
	tls   *tls.ConnectionState
	hello *fingerprint.ClientHello
	tap   *capture.Conn
}

type connKey struct{}

// Start listens on opts.Addr and serves until Close.
func Start(opts Options) (*Origin, error) {
	addr := opts.Addr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	o := &Origin{handler: opts.Handler, refuse: opts.Refuse, changed: make(chan struct{}), raw: make(map[net.Conn]bool)}
	if o.handler == nil {
		o.handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	}
	if !opts.Plain {
		ca, err := newTestCA(append([]string{"localhost", "127.0.0.1", "::1"}, opts.Hosts...))
		if err != nil {
			return nil, err
		}
		dir, err := os.MkdirTemp("", "fporigin-")
		if err != nil {
			return nil, fmt.Errorf("fporigin: %w", err)
		}
		if err := os.WriteFile(filepath.Join(dir, "ca.pem"), ca.certPEM, 0o644); err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("fporigin: %w", err)
		}
		o.ca, o.caDir = ca, dir
		protos := opts.NextProtos
		if protos == nil {
			protos = []string{"h2", "http/1.1"}
		}
		o.tlsConf = &tls.Config{
			Certificates: []tls.Certificate{ca.leaf},
			NextProtos:   protos,
			// A resuming client would send this origin's ticket in its
			// next hello; every hello is to be a first one.
			SessionTicketsDisabled: true,
		}
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		o.removeCA()
		return nil, fmt.Errorf("fporigin: %w", err)
	}
	o.ln = ln
	o.inner = newPushListener(ln.Addr())
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetHTTP2(true)
	protocols.SetUnencryptedHTTP2(true) // how net/http serves a tapped conn's HTTP/2
	o.srv = &http.Server{
		Handler:           http.HandlerFunc(o.serve),
		Protocols:         &protocols,
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          log.New(io.Discard, "", 0),
		HTTP2:             &http.HTTP2Config{MaxConcurrentStreams: opts.MaxConcurrentStreams},
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return context.WithValue(ctx, connKey{}, c.(*originConn).info)
		},
	}
	o.wg.Add(2)
	go func() {
		defer o.wg.Done()
		o.srv.Serve(o.inner)
	}()
	go func() {
		defer o.wg.Done()
		o.acceptLoop()
	}()
	return o, nil
}

// originConn carries a connection's info to ConnContext.
type originConn struct {
	*capture.Conn
	info *connInfo
}

func (o *Origin) acceptLoop() {
	var backoff time.Duration
	for {
		c, err := o.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		o.wg.Add(1)
		go func() {
			defer o.wg.Done()
			o.handshake(c)
		}()
	}
}

// handshake reads the hello, completes TLS and hands the tapped connection
// to the server.
func (o *Origin) handshake(c net.Conn) {
	o.mu.Lock()
	if o.closed {
		o.mu.Unlock()
		c.Close()
		return
	}
	o.conns++
	info := &connInfo{id: o.conns}
	o.raw[c] = true
	o.mu.Unlock()
	defer func() {
		o.mu.Lock()
		delete(o.raw, c)
		o.mu.Unlock()
	}()
	var conn net.Conn = c
	if o.tlsConf != nil {
		c.SetDeadline(time.Now().Add(10 * time.Second))
		rc, hello, _ := capture.PeekClientHello(c) // a hello that does not parse is recorded as nil
		conf := o.tlsConf
		if o.refuse != nil {
			conf = conf.Clone()
			conf.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
				if hello == nil {
					return nil, nil
				}
				return nil, o.refuse(hello)
			}
		}
		tc := tls.Server(rc, conf)
		if err := tc.Handshake(); err != nil {
			c.Close()
			return
		}
		c.SetDeadline(time.Time{})
		st := tc.ConnectionState()
		info.tls, info.hello, conn = &st, hello, tc
	}
	info.tap = capture.NewConn(conn, info.hello)
	if err := o.inner.push(&originConn{Conn: info.tap, info: info}); err != nil {
		c.Close()
	}
}

func (o *Origin) serve(w http.ResponseWriter, r *http.Request) {
	info := r.Context().Value(connKey{}).(*connInfo)
	rec := Record{
		Conn:   info.id,
		Method: r.Method, Host: r.Host, Path: r.URL.RequestURI(), Proto: r.Proto,
		Header: r.Header.Clone(),
		Shape:  info.tap.Shape(r),
		Hello:  info.hello,
	}
	if info.tls != nil {
		rec.TLS, rec.TLSVersion, rec.ALPN = true, info.tls.Version, info.tls.NegotiatedProtocol
	}
	if rec.Hello != nil {
		rec.JA4, rec.JA3 = rec.Hello.JA4(), rec.Hello.JA3()
	}
	if fp := info.tap.Fingerprint(); fp != nil && fp.H2 != nil {
		rec.H2, rec.Akamai = fp.H2, fp.H2.Akamai()
	}
	o.mu.Lock()
	rec.Seq = len(o.records) + 1
	o.records = append(o.records, rec)
	close(o.changed)
	o.changed = make(chan struct{})
	o.mu.Unlock()
	o.handler.ServeHTTP(w, r)
}

// URL is the origin's base URL, "https://127.0.0.1:port" (http when Plain).
func (o *Origin) URL() string {
	if o.tlsConf == nil {
		return "http://" + o.ln.Addr().String()
	}
	return "https://" + o.ln.Addr().String()
}

// Addr is the address the origin listens on.
func (o *Origin) Addr() string { return o.ln.Addr().String() }

// Port is the port the origin listens on.
func (o *Origin) Port() string {
	_, port, _ := net.SplitHostPort(o.ln.Addr().String())
	return port
}

// CertPool holds the origin's CA (nil when Plain).
func (o *Origin) CertPool() *x509.CertPool {
	if o.ca == nil {
		return nil
	}
	p := x509.NewCertPool()
	p.AddCert(o.ca.cert)
	return p
}

// CAFile is the path of the CA certificate in PEM ("" when Plain), for
// curl --cacert and Python's verify=. Close removes it.
func (o *Origin) CAFile() string {
	if o.ca == nil {
		return ""
	}
	return filepath.Join(o.caDir, "ca.pem")
}

// SPKIHash is the base64 SHA-256 of the origin certificate's public key, the
// form Chromium's --ignore-certificate-errors-spki-list takes.
func (o *Origin) SPKIHash() string {
	if o.ca == nil {
		return ""
	}
	return o.ca.spki
}

// Records returns what the origin recorded so far, oldest first.
func (o *Origin) Records() []Record {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]Record(nil), o.records...)
}

// Wait returns the records once there are at least n, or ctx's error.
func (o *Origin) Wait(ctx context.Context, n int) ([]Record, error) {
	for {
		o.mu.Lock()
		recs, changed := append([]Record(nil), o.records...), o.changed
		o.mu.Unlock()
		if len(recs) >= n {
			return recs, nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return recs, fmt.Errorf("fporigin: %d of %d requests: %w", len(recs), n, ctx.Err())
		}
	}
}

// Reset forgets the records (connections keep their numbers).
func (o *Origin) Reset() {
	o.mu.Lock()
	o.records = nil
	o.mu.Unlock()
}

// Close stops the origin, closes its connections and waits for its
// goroutines.
func (o *Origin) Close() error {
	err := o.ln.Close()
	o.mu.Lock()
	o.closed = true
	for c := range o.raw {
		c.Close()
	}
	o.mu.Unlock()
	o.inner.Close()
	o.srv.Close()
	o.wg.Wait()
	o.removeCA()
	return err
}

func (o *Origin) removeCA() {
	if o.caDir != "" {
		os.RemoveAll(o.caDir)
	}
}

// pushListener is a net.Listener whose connections are handed to it.
type pushListener struct {
	addr   net.Addr
	conns  chan net.Conn
	done   chan struct{}
	closed sync.Once
}

func newPushListener(addr net.Addr) *pushListener {
	return &pushListener{addr: addr, conns: make(chan net.Conn), done: make(chan struct{})}
}

func (l *pushListener) push(c net.Conn) error {
	select {
	case l.conns <- c:
		return nil
	case <-l.done:
		return net.ErrClosed
	}
}

func (l *pushListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *pushListener) Close() error {
	l.closed.Do(func() { close(l.done) })
	return nil
}

func (l *pushListener) Addr() net.Addr { return l.addr }
