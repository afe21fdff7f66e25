package proxy

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/elazarl/goproxy"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/connlimit"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/capture"
	"github.com/seed-a3c387e8/onceproxy/internal/halfclose"
	"github.com/seed-a3c387e8/onceproxy/internal/readahead"
	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
)

// The requests inside an intercepted CONNECT tunnel are read by an
// http.Server of our own, not by goproxy's MITM loop, which parses them with
// http.ReadRequest: no cap on a header line (one authenticated client could
// make the process buffer a gigabyte of "header"), no header timeout, and a
// malformed request closed the connection without an answer. net/http
// enforces max_header_bytes and read_header_timeout here as on the proxy
// port, answers 400 or 431 with a reason, negotiates HTTP/2 (ALPN, and h2c
// inside a plain tunnel), bounds HTTP/2 streams, and drains on Shutdown.
// Each decrypted request then takes goproxy's request path (handle, the
// response copy, WebSocket splicing) exactly like a plain proxy request, so
// the two paths cannot drift apart.
//
// The origin must see the client, not the proxy: before crypto/tls reads
// the client's ClientHello, the raw hello is kept, and the decrypted stream
// the inner server reads goes through a tap (capture.Conn) that records the
// client's HTTP/2 preface and each request's header order. Both ride in
// every request's context (fingerprint.WithFingerprint, WithShape) to the
// upstream, which opens the origin connection with them; a flight's leader
// carries its own into the flight. The proxy port's connections are tapped
// too, for the header order of plain http:// requests.

// recordTypeHandshake starts every TLS stream (a ClientHello record).
const recordTypeHandshake = 0x16

// tunnel is what the CONNECT that opened a tunnel tells its requests.
type tunnel struct {
	info       clientinfo.Info // who opened it: user, account, session hint, client
	host       string          // the CONNECT target, host:port
	remoteAddr string          // the client's address, as on the CONNECT (or SOCKS5 connection)
	scheme     string          // "https" when the client spoke TLS, else "http"
	// tap reads the client's fingerprint off the decrypted stream.
	tap *capture.Conn
	// tallied: the fingerprint was counted for the status page.
	tallied atomic.Bool
}

type tunnelKey struct{}

// tunnelFrom returns the tunnel a request arrived through, or nil.
func tunnelFrom(ctx context.Context) *tunnel {
	t, _ := ctx.Value(tunnelKey{}).(*tunnel)
	return t
}

// tappedConn is a client connection read through a fingerprint tap: a
// tunnel's decrypted (or plain) stream handed to the inner server, with
// the tunnel it belongs to (ConnContext puts it in every request's
// context), or a proxy-port connection (t nil). It has no ConnectionState
// method, on purpose (see capture.Conn), and sees through to the
// connection under the tap for half-closes and the connection limits.
type tappedConn struct {
	*capture.Conn
	t *tunnel
	// replay holds what the lean loop read ahead when it handed the
	// connection to the inner server (see handOff): read first, and not
	// by the tap, which saw it already.
	replay []byte
	// headBy, set by the lean loop's handOff, bounds the first read
	// deadline the inner server sets (its header timeout for the request
	// the loop began reading): the head keeps the time it had left.
	headBy time.Time
}

// SetReadDeadline sets the read deadline, the first one after a handoff
// no later than headBy.
func (c *tappedConn) SetReadDeadline(t time.Time) error {
	if by := c.headBy; !by.IsZero() {
		c.headBy = time.Time{}
		if !t.IsZero() && t.After(by) {
			t = by
		}
	}
	return c.Conn.SetReadDeadline(t)
}

func (c *tappedConn) Read(p []byte) (int, error) {
	if len(c.replay) > 0 {
		n := copy(p, c.replay)
		c.replay = c.replay[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

func (c *tappedConn) Unwrap() net.Conn  { return c.NetConn() }
func (c *tappedConn) CloseWrite() error { return halfclose.CloseWrite(c.NetConn()) }
func (c *tappedConn) CloseRead() error  { return halfclose.CloseRead(c.NetConn()) }

// tunnelHost is where a request in a tunnel to target goes, its Host
// field (HTTP/2: :authority) being host: host, with the tunnel's port when
// it names the tunnel's host without one (the client's bytes went to that
// port, not to the scheme's default), or the target when host is empty.
func tunnelHost(host, target string) string {
	if host == "" {
		return target
	}
	if _, _, err := net.SplitHostPort(host); err == nil {
		return host
	}
	name, _, err := net.SplitHostPort(target)
	if err == nil && strings.EqualFold(strings.Trim(host, "[]"), name) {
		return target
	}
	return host
}

// The protocols the MITM offers a client: HTTP/2 and HTTP/1.1.
var mitmNextProtos = []string{"h2", "http/1.1"}

// mitmProtos is the NextProtos of the MITM's handshake with a client
// whose hello is hello (nil: it did not parse). A client that offers none
// of ours (curl --http1.0 offers only "http/1.0") gets no protocol chosen,
// as from a server that does not negotiate, and speaks HTTP/1.x: Go would
// refuse its handshake instead (no_application_protocol), and so does no
// origin that serves HTTP/1.0.
func mitmProtos(hello *fingerprint.ClientHello) []string {
	if hello == nil || len(hello.ALPN) == 0 {
		return mitmNextProtos
	}
	for _, p := range hello.ALPN {
		if slices.Contains(mitmNextProtos, p) {
			return mitmNextProtos
		}
	}
	return nil
}

// clientProtos is the NextProtos of the MITM's handshake with a client
// whose hello is hello, in a tunnel to host. Directly, the client would
// offer the origin its protocols and speak the one the origin picks; here
// the MITM picks, before the origin is dialled, so it picks what the
// origin picked the last time a client's offer included HTTP/2
// (Options.Origins). A browser at an origin that speaks only HTTP/1.1
// then speaks HTTP/1.1 to the proxy too, and its requests reach the
// origin as it wrote them, where, offered HTTP/2, it sent HTTP/2
// requests that reached the origin translated (in HTTP/2's header order,
// without the client's own HTTP/1.1 spelling). An origin not reached
// yet, or one that speaks HTTP/2, gets mitmProtos; so does a client that
// does not offer HTTP/1.1 (gRPC offers h2 alone).
func (s *Server) clientProtos(hello *fingerprint.ClientHello, host string) []string {
	protos := mitmProtos(hello)
	if protos == nil || hello == nil || s.origins == nil || !slices.Contains(hello.ALPN, "http/1.1") {
		return protos
	}
	p, known := s.origins.OriginProtocol(host)
	switch {
	case !known:
		return protos
	case p == "http/1.1":
		return []string{"http/1.1"}
	case p == "":
		// An origin that negotiates nothing: no protocol chosen here
		// either, and the client speaks HTTP/1.1, as it would there.
		return nil
	}
	return protos
}

// replayed is the connection capture.PeekClientHello returns, which
// replays the hello it read, seen through to the client connection under
// it (connlimit and halfclose look for it).
type replayed struct {
	net.Conn
	under net.Conn
}

func (r replayed) Unwrap() net.Conn  { return r.under }
func (r replayed) CloseWrite() error { return halfclose.CloseWrite(r.under) }
func (r replayed) CloseRead() error  { return halfclose.CloseRead(r.under) }

// fingerprintCtx returns ctx with the client's fingerprint and r's shape,
// as read by tap, for the upstream to mirror, and the fingerprint (nil
// while the tap has none). Every request read off a tapped connection must
// pass here: on HTTP/1.x the tap drops the shapes of the requests before
// the one asked for. It returns a context, not a request: the front door
// copies the request once, with everything its context gains (see serve).
func fingerprintCtx(ctx context.Context, r *http.Request, tap *capture.Conn) (context.Context, *fingerprint.Fingerprint) {
	shape := tap.Shape(r)
	fp := tap.Fingerprint()
	return withFingerprint(ctx, fp, shape), fp
}

// withFingerprint returns ctx with fp and, if any, shape; ctx itself
// while there is no fingerprint.
func withFingerprint(ctx context.Context, fp *fingerprint.Fingerprint, shape *fingerprint.Shape) context.Context {
	if fp == nil {
		return ctx
	}
	ctx = fingerprint.WithFingerprint(ctx, fp)
	if shape != nil {
		ctx = fingerprint.WithShape(ctx, shape)
	}
	return ctx
}

// plainShapeCtx gives an absolute-form http:// request on the proxy port
// its client's header order, in ctx, the request's. Other requests there
// (https:// in absolute form, the /fetch API) keep the Go way: the
// connection's TLS, if any, was never the origin's business.
func plainShapeCtx(ctx context.Context, req *http.Request) context.Context {
	tc, _ := ctx.Value(clientConnKey{}).(*tappedConn)
	if tc == nil {
		return ctx
	}
	shape := tc.Shape(req) // also keeps the tap's queue in step
	if req.URL.Scheme != "http" || shape == nil {
		return ctx
	}
	return withFingerprint(ctx, tc.Fingerprint(), shape)
}

// newInner builds the server for intercepted tunnels. It shares the proxy
// port's limits.
func (s *Server) newInner() *http.Server {
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetHTTP2(true)
	// h2c with prior knowledge in a plain tunnel; and a tapped TLS stream
	// is no *tls.Conn, so net/http tells HTTP/2 by its preface there too.
	protocols.SetUnencryptedHTTP2(true)
	return &http.Server{
		Handler:           http.HandlerFunc(s.serveIntercepted),
		ReadHeaderTimeout: s.cfg.ReadHeaderTimeout,
		IdleTimeout:       s.cfg.IdleTimeout,
		MaxHeaderBytes:    s.cfg.MaxHeaderBytes,
		Protocols:         &protocols,
		ErrorLog:          log.New(innerLog{s.logger}, "", 0),
		ConnState:         connlimit.ConnState,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			if tc, ok := c.(*tappedConn); ok && tc.t != nil {
				ctx = context.WithValue(ctx, tunnelKey{}, tc.t)
			}
			return ctx
		},
	}
}

// innerLog sends what the inner http.Server reports to the log.
type innerLog struct{ l *slog.Logger }

func (w innerLog) Write(p []byte) (int, error) {
	w.l.Warn("intercepted tunnel: " + strings.TrimSpace(string(p)))
	return len(p), nil
}

// handshakeFailed logs an interception handshake that failed. A client
// that rejects the interception certificate is the one thing an operator
// must act on (install the CA), so it says so; a tunnel closed before or
// during the handshake (browsers open spare ones) is routine.
func (s *Server) handshakeFailed(t *tunnel, err error) {
	msg := err.Error()
	if strings.Contains(msg, "bad certificate") || strings.Contains(msg, "unknown certificate") {
		s.logger.Warn("a client rejected the interception certificate: it does not trust onceproxy's CA yet (see README: Clients)",
			"client", t.remoteAddr, "target", t.host, "detail", msg)
		return
	}
	s.logger.Debug("intercepted tunnel: TLS handshake error", "client", t.remoteAddr, "target", t.host, "err", msg)
}

// startInner serves the inner server on first use, unless Shutdown came
// first. Shutdown stops it.
func (s *Server) startInner() {
	s.innerMu.Lock()
	defer s.innerMu.Unlock()
	if s.innerStarted || s.innerClosed {
		return
	}
	s.innerStarted = true
	s.innerWG.Add(1)
	go func() {
		defer s.innerWG.Done()
		if err := s.inner.Serve(s.innerLn); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.logger.Error("serving intercepted tunnels stopped", "err", err)
		}
	}()
}

// shutdownInner stops taking tunnels, closes the idle ones the inner
// server holds and waits, until ctx ends, for the requests it is reading
// or answering (the tunnels' lean loop is stopped beside it, in
// Shutdown).
func (s *Server) shutdownInner(ctx context.Context) error {
	s.innerMu.Lock()
	s.innerClosed = true
	s.innerMu.Unlock()
	s.innerLn.Close() // also when never served: a pending push must fail
	err := s.inner.Shutdown(ctx)
	s.innerWG.Wait()
	return err
}

// hijackConnect is the Hijack of an intercepted CONNECT (goproxy has
// authenticated and checked it in handleConnect): confirm the tunnel, then
// intercept it.
func (s *Server) hijackConnect(req *http.Request, client net.Conn, pctx *goproxy.ProxyCtx) {
	info, _ := pctx.UserData.(clientinfo.Info)
	proto := req.Proto
	if !strings.HasPrefix(proto, "HTTP/1.") {
		proto = "HTTP/1.1"
	}
	if _, err := io.WriteString(client, proto+" 200 Connection established\r\n\r\n"); err != nil {
		client.Close()
		return
	}
	s.intercept(client, &tunnel{info: info, host: req.URL.Host, remoteAddr: req.RemoteAddr})
}

// intercept looks at the first byte of a tunnel's client stream (a CONNECT
// tunnel's, or a SOCKS5 one's) to tell TLS from plain HTTP, terminates
// TLS, and hands the decrypted stream, tapped for the client's
// fingerprint, to the inner server, which closes it when done.
func (s *Server) intercept(client net.Conn, t *tunnel) {
	// A tunnel must start speaking within read_header_timeout, as a request
	// on the proxy port must: a silent one holds a connection slot for
	// nothing, and thousands of them locked every new client out. A
	// browser reopens a spare tunnel cut this way when it needs one.
	_ = client.SetReadDeadline(time.Now().Add(s.cfg.ReadHeaderTimeout))
	var first [1]byte
	if _, err := io.ReadFull(client, first[:]); err != nil {
		client.Close()
		return
	}
	t.scheme = "http"
	stream := readahead.New(client, first[:])
	h2 := false
	if first[0] == recordTypeHandshake {
		t.scheme = "https"
		_ = client.SetDeadline(time.Now().Add(s.cfg.ReadHeaderTimeout))
		rc, hello, err := capture.PeekClientHello(stream)
		if err != nil {
			s.logger.Debug("intercepted tunnel: the ClientHello did not parse; its requests go out with Go's",
				"client", t.remoteAddr, "target", t.host, "err", err)
		}
		if socks.BlindHello(hello) {
			// A fully qualified SNI, or no HTTP among the protocols the
			// client offers: the tunnel goes to its target blind, as it
			// is.
			_ = client.SetDeadline(time.Time{})
			s.tunnelBlind(client, rc, t)
			return
		}
		tc, err := s.terminateTLS(client, rc, stream, hello, t)
		if err != nil {
			s.handshakeFailed(t, err)
			client.Close()
			return
		}
		t.tap = capture.NewConn(tc, hello)
		h2 = tc.ConnectionState().NegotiatedProtocol == "h2"
	} else {
		// Still under the read deadline: enough of the first line to
		// tell HTTP from anything else a client speaks first (SSH's
		// banner, a Redis or IRC client), which goes to the target
		// blind instead of to an HTTP loop that would never answer it.
		c, isHTTP := peekHTTP(stream)
		_ = client.SetReadDeadline(time.Time{})
		if !isHTTP {
			s.tunnelBlind(client, c, t)
			return
		}
		t.tap = capture.NewConn(c, nil)
	}
	conn := &tappedConn{Conn: t.tap, t: t}
	if !h2 {
		// HTTP/1.1, or h2c in a plain tunnel, which the lean loop hands
		// over at its preface.
		s.serveH1(&s.tunnels, conn)
		return
	}
	s.pushInner(conn)
}

// peekHTTP reads ahead of stream, not past the first line, until its
// first bytes say whether it is HTTP; the returned connection replays
// them. A stream that stops before that (the deadline, a hang-up) counts
// as HTTP: the HTTP loop answers it as it answers any cut request.
func peekHTTP(stream net.Conn) (net.Conn, bool) {
	br := bufio.NewReaderSize(stream, 64)
	for n := 1; ; n++ {
		b, err := br.Peek(n)
		if isHTTP, decided := socks.HTTPStart(b); decided {
			return readahead.Buffered(stream, br), isHTTP
		}
		if err != nil {
			return readahead.Buffered(stream, br), true
		}
		n = max(n, br.Buffered()-1) // look at all that came before asking for more
	}
}

// tunnelBlind carries a tunnel that is neither TLS nor HTTP to its target
// byte for byte, through the upstream a blind CONNECT would take. The
// client was told 200 already: a failed dial can only close it.
func (s *Server) tunnelBlind(client, fromClient net.Conn, t *tunnel) {
	// The SOCKS5 door's dial: one request for the rate limit, as a
	// bypass CONNECT's or a SOCKS5 blind tunnel's is (the dial is
	// upstream work), and a refusal of the guard at dial time counted as
	// theirs are. This path dialled on its own once, and went uncounted.
	ctx := clientinfo.With(context.Background(), t.info)
	up, err := s.DialTunnel(ctx, socks.Tunnel{Target: t.host, Client: t.remoteAddr})
	if err != nil {
		s.logger.Warn("tunnel to a non-HTTP service failed", "target", t.host, "client", t.remoteAddr, "err", err)
		client.Close()
		return
	}
	if err := socks.Splice(context.Background(), client, fromClient, up, up); err != nil {
		s.logger.Debug("tunnel to a non-HTTP service ended with an error", "target", t.host, "err", err)
	}
}

// pushInner hands a tunnel's connection to the inner server.
func (s *Server) pushInner(c *tappedConn) {
	s.startInner()
	if err := s.innerLn.push(c); err != nil {
		c.Close() // shutting down
	}
}

// terminateTLS completes the TLS handshake of a tunnel's client side
// (stream; client the connection under it; rc replays the ClientHello
// intercept read off stream, parsed as hello) with a certificate for its
// SNI, within the read_header_timeout intercept set. The hello is nil
// when it did not parse: the handshake goes on and the tunnel's requests
// go out the Go way.
func (s *Server) terminateTLS(client, rc, stream net.Conn, hello *fingerprint.ClientHello, t *tunnel) (*tls.Conn, error) {
	cfg := s.certs.ServerConfig(t.host).Clone()
	cfg.NextProtos = s.clientProtos(hello, t.host)
	// A client resuming a session would put onceproxy's ticket (a
	// pre_shared_key) into its next hello, which the origin never issued:
	// without tickets every hello is a first one, as the origin sees it.
	cfg.SessionTicketsDisabled = true
	tc := tls.Server(replayed{Conn: rc, under: stream}, cfg)
	if err := tc.Handshake(); err != nil {
		return nil, err
	}
	_ = client.SetDeadline(time.Time{})
	return tc, nil
}

// serveIntercepted completes a decrypted request into the absolute form a
// proxy request has, then forwards it like one. An HTTP/2 request is
// served on one of the handler workers: net/http runs every stream on a
// goroutine of its own, whose first stack the proxy's path outgrew, and
// the runtime copied it for every request (5–6% of the CPU of unique
// HTTP/2 misses, pprof of onceload -compare's load). HTTP/1.x requests
// run on their connection's goroutine, which keeps its grown stack.
func (s *Server) serveIntercepted(w http.ResponseWriter, r *http.Request) {
	if r.ProtoMajor == 2 {
		s.handlers.Do(func() { s.serveDecrypted(w, r) })
		return
	}
	s.serveDecrypted(w, r)
}

func (s *Server) serveDecrypted(w http.ResponseWriter, r *http.Request) {
	// Every answer goes through fw, the MITM's own refusals too: over
	// HTTP/2 each is bounded by its stream's idle deadline.
	fw := streamTo(w)
	if r.ProtoMajor == 2 {
		fw.idleStream(s.cfg.IdleTimeout)
	}
	t := tunnelFrom(r.Context())
	if t == nil {
		writeResponse(fw, errorResponse(r, http.StatusInternalServerError, kindInternal,
			"internal error: a request without its tunnel"))
		return
	}
	if r.Method == http.MethodConnect {
		writeResponse(fw, errorResponse(r, http.StatusBadRequest, kindBadRequest,
			"CONNECT inside an intercepted tunnel is not supported"))
		return
	}
	r.URL.Scheme = t.scheme
	if r.URL.Host == "" {
		// Origin-form: the Host header (HTTP/2: :authority) names the
		// origin, as it would for the origin itself; the CONNECT target
		// stands in when the client sent neither.
		r.URL.Host = tunnelHost(r.Host, t.host)
	}
	r.RemoteAddr = t.remoteAddr
	ctx := r.Context()
	if t.tap != nil {
		var fp *fingerprint.Fingerprint
		ctx, fp = fingerprintCtx(ctx, r, t.tap)
		if fp != nil && t.tallied.CompareAndSwap(false, true) {
			s.clientFPs.Add(fp, time.Now())
		}
	}
	s.forwardCtx(ctx, fw, r)
}

// clientFingerprintsShown is how many fingerprints the status page lists;
// clientFingerprintsKept how many recent distinct ones are counted.
const (
	clientFingerprintsShown = 20
	clientFingerprintsKept  = 256
)

// ClientFingerprints returns the most frequent fingerprints of recent
// intercepted client connections (JA4, HTTP version, Akamai string), for
// the status page.
func (s *Server) ClientFingerprints() []fingerprint.Seen {
	return s.clientFPs.Top(clientFingerprintsShown)
}

// writeResponse writes a response built by errorResponse to w.
func writeResponse(w http.ResponseWriter, resp *http.Response) {
	for k, v := range resp.Header {
		w.Header()[k] = v
	}
	w.WriteHeader(resp.StatusCode)
	if resp.Body != nil {
		_, _ = io.Copy(w, resp.Body)
		resp.Body.Close()
	}
}
