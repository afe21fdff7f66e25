package upstream

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/textproto"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	utls "github.com/bogdanfinn/utls"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/upstream/mirror"
)

// helloCounts counts the origin connections by how their TLS hello was
// made: the client's (mirror.Mirrored), the closest the TLS library could
// complete (mirror.Closest), or Go's (mirror.Go: net/http's transports,
// and the mirror's last resort).
type helloCounts [mirror.Go + 1]atomic.Int64

func (h *helloCounts) add(m mirror.Mode) {
	if m >= mirror.Mirrored && m <= mirror.Go {
		h[m].Add(1)
	}
}

// countGoHellos returns a copy of cfg for a net/http transport that counts
// each TLS connection it completes as a Go hello. VerifyConnection runs once
// per completed client handshake, whatever InsecureSkipVerify says, so it is
// the one hook that sees every connection net/http opens.
func countGoHellos(cfg *tls.Config, h *helloCounts) *tls.Config {
	c := cfg.Clone()
	verify := c.VerifyConnection
	c.VerifyConnection = func(cs tls.ConnectionState) error {
		if verify != nil {
			if err := verify(cs); err != nil {
				return err
			}
		}
		h.add(mirror.Go)
		return nil
	}
	return c
}

// mirroredTransport sends the requests of intercepted clients over origin
// connections opened with the client's own fingerprint (package mirror):
// its ClientHello, the HTTP version its ALPN offer leads to, its HTTP/2
// preface, and each request's header order. It belongs to one session (or
// to direct egress), so its connections all leave through one exit.
//
// Connections are pooled per fingerprint identity and origin: one opened
// with a client's hello never carries a request of a client with another
// hello or HTTP/2 preface, since the origin has seen the first one's. The
// pool is bounded like net/http's (idle connections per origin and
// fingerprint, idle connections in all, an idle timeout), and a rotation
// retires every connection at once: idle ones close, busy ones when done.
type mirroredTransport struct {
	dialer *mirror.Dialer // https: the client's hello over dial
	// dial opens the connection under plain http requests (and, through
	// dialer, under TLS ones): to the origin, or a tunnel to it.
	dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// plain: plain http requests may use this transport (false behind an
	// HTTP gateway, which wants them in absolute form).
	plain           bool
	keepAlive       bool // false: a connection per request (per_request sessions)
	idleConnTimeout time.Duration
	maxIdlePerHost  int
	maxIdle         int
	headerTimeout   time.Duration
	opts            mirror.Options // of every connection
	hellos          *helloCounts
	alpn            *alpnMemory // what each origin chose, for the MITM
	log             *slog.Logger

	mu      sync.Mutex // guards the fields below and every mconn's active, idle and timer
	conns   map[connKey][]*mconn
	dialing map[connKey]*pendingDial // an HTTP/2-capable dial in progress
	nIdle   int
	gen     uint64 // bumped by closeIdle: connections of an older one are never reused
	closed  bool
}

// connKey is what a pooled connection may be reused for.
type connKey struct {
	id   fingerprint.ID // the client fingerprint the TLS connection was opened with; zero for plain http
	tls  bool
	addr string // host:port
}

// mconn is one pooled origin connection.
type mconn struct {
	cc     mirror.ClientConn
	key    connKey
	gen    uint64
	h2     bool
	active int  // requests using it (HTTP/1.1: at most one)
	idle   bool // counted in nIdle, with timer running
	// shunned: takes no new request (see shun); closes with its last.
	shunned bool
	timer   *time.Timer
}

// maxMirrorAttempts bounds how often one request is sent again on a new
// connection after its connection turned out dead before the origin took it.
const maxMirrorAttempts = 3

func (k *connKit) mirroredTransport(dial dialFunc, plain, keepAlive bool, idleConnTimeout time.Duration) *mirroredTransport {
	tlsConf := k.tls.Clone()
	// Offered only by the Go hello the mirror falls back to for a client
	// whose own hello could not be read: what net/http would offer.
	tlsConf.NextProtos = []string{"h2", "http/1.1"}
	timeout := k.cfg.DialTimeout
	bounded := dial
	dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
		// The request's context may allow far longer than a dial: a
		// gateway that accepts and then says nothing must cost the dial
		// timeout, as under net/http (which dials without a deadline, so
		// the dial funcs apply theirs).
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		return bounded(ctx, network, addr)
	}
	return &mirroredTransport{
		dialer: &mirror.Dialer{
			Dial:             dial,
			TLSConfig:        tlsConf,
			HandshakeTimeout: k.cfg.TLSHandshakeTimeout,
		},
		dial:            dial,
		plain:           plain,
		keepAlive:       keepAlive,
		idleConnTimeout: idleConnTimeout,
		maxIdlePerHost:  k.cfg.MaxIdleConnsPerHost,
		maxIdle:         k.cfg.MaxIdleConns,
		headerTimeout:   k.cfg.ResponseHeaderTimeout,
		opts:            mirror.Options{PingTimeout: k.cfg.PingTimeout},
		hellos:          &k.hellos,
		alpn:            k.alpn,
		log:             k.log,
		conns:           make(map[connKey][]*mconn),
		dialing:         make(map[connKey]*pendingDial),
	}
}

// takes reports whether req goes through t rather than net/http: it
// carries a client's fingerprint (only requests read off an intercepted or
// tapped client connection do), it is not a protocol switch (the mirror's
// HTTP/2 client has no extended CONNECT, and a switched connection is
// net/http's to splice), and a plain one came over HTTP/1.x with its shape
// known, which is all a plain origin connection can reproduce.
func (t *mirroredTransport) takes(req *http.Request) bool {
	if t == nil || fingerprint.FingerprintFrom(req.Context()) == nil || req.Header.Get("Upgrade") != "" {
		return false
	}
	switch req.URL.Scheme {
	case "https":
		return true
	case "http":
		return t.plain && req.ProtoMajor == 1 && fingerprint.ShapeFrom(req.Context()) != nil
	}
	return false
}

// RoundTrip sends req over a connection made with the fingerprint in its
// context (fingerprint.WithFingerprint), reused or new.
func (t *mirroredTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	fp := fingerprint.FingerprintFrom(ctx)
	if fp == nil {
		closeBody(req)
		return nil, errors.New("upstream: internal: a mirrored request without a fingerprint")
	}
	key := connKey{tls: req.URL.Scheme == "https", addr: canonicalAddr(req)}
	if key.tls {
		key.id = fp.ID()
	}
	for attempt := 1; ; attempt++ {
		mc, reused, err := t.conn(ctx, key, fp)
		if err != nil {
			closeBody(req)
			return nil, err
		}
		resp, err := t.send(mc, req)
		if err == nil {
			return resp, nil
		}
		t.done(mc)
		if attempt >= maxMirrorAttempts || !retryable(err, reused, req) {
			return nil, err
		}
		next, rerr := rewind(req)
		if rerr != nil {
			return nil, err
		}
		req = next
	}
}

// canonicalAddr is the host:port req goes to.
func canonicalAddr(req *http.Request) string {
	host, port := req.URL.Hostname(), req.URL.Port()
	if port == "" {
		port = "443"
		if req.URL.Scheme == "http" {
			port = "80"
		}
	}
	return net.JoinHostPort(host, port)
}

func closeBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}

// conn returns a connection for key that can take a request now, marked
// in use: a pooled one, or a new one.
func (t *mirroredTransport) conn(ctx context.Context, key connKey, fp *fingerprint.Fingerprint) (mc *mconn, reused bool, err error) {
	// An HTTP/2 client opens one connection to an origin and multiplexes
	// on it; so does this pool, instead of racing a dial per request (a
	// burst of misses would otherwise show the origin a burst of
	// connections no browser makes). Only while nothing says the origin
	// answers this hello with HTTP/1.1.
	h2 := key.tls && fp.Hello != nil && slices.Contains(fp.Hello.ALPN, "h2")
	for {
		t.mu.Lock()
		if t.closed {
			t.mu.Unlock()
			return nil, false, errors.New("upstream: connection pool closed")
		}
		if t.keepAlive {
			mc, dead := t.takeLocked(key)
			if len(dead) > 0 || mc != nil {
				t.mu.Unlock()
				closeAll(dead)
				if mc != nil && t.fit(mc) {
					return mc, true, nil
				}
				continue
			}
		}
		var mine *pendingDial
		if t.keepAlive && h2 && !t.hasH1Locked(key) {
			if d, ok := t.dialing[key]; ok {
				t.mu.Unlock()
				select {
				case <-d.done:
					if d.err != nil {
						return nil, false, d.err
					}
					continue
				case <-ctx.Done():
					return nil, false, ctx.Err()
				}
			}
			mine = &pendingDial{done: make(chan struct{})}
			t.dialing[key] = mine
		}
		gen := t.gen
		t.mu.Unlock()

		mc, err := t.open(ctx, key, fp, gen)
		t.mu.Lock()
		if mine != nil {
			if err != nil && ctx.Err() == nil {
				// The origin's failure, not this request's leaving:
				// the requests that waited share it rather than each
				// dialing again in turn, a timeout apiece.
				mine.err = err
			}
			delete(t.dialing, key)
			close(mine.done)
		}
		if err == nil && t.closed {
			t.mu.Unlock()
			mc.cc.Close()
			return nil, false, errors.New("upstream: connection pool closed")
		}
		if err != nil {
			t.mu.Unlock()
			return nil, false, err
		}
		mc.active = 1
		t.conns[key] = append(t.conns[key], mc)
		t.mu.Unlock()
		return mc, false, nil
	}
}

// pendingDial is an HTTP/2-capable dial in progress, which requests for
// the same key wait for instead of dialing alongside.
type pendingDial struct {
	done chan struct{} // closed when it ends
	// err, set before done closes: the dial failed, and not because its
	// own request left.
	err error
}

// takeLocked marks a pooled connection for key that can take a request
// now as used, and returns it; nil when there is none. Unused connections
// that can take no more requests leave the pool and are returned in dead,
// for the caller to close once mu is released. mu held.
func (t *mirroredTransport) takeLocked(key connKey) (mc *mconn, dead []*mconn) {
	list := t.conns[key]
	for i := len(list) - 1; i >= 0; i-- { // the most recently added first
		c := list[i]
		if c.gen != t.gen || c.shunned || !c.h2 && c.active > 0 {
			continue
		}
		if !c.cc.CanTakeRequest() {
			if c.active == 0 {
				dead = append(dead, c)
			}
			continue
		}
		t.unidleLocked(c)
		c.active++
		mc = c
		break
	}
	for _, c := range dead {
		t.removeLocked(c)
	}
	return mc, dead
}

// A prober is a pooled connection that nothing watches while it is idle
// (HTTP/1.1: no reader runs between requests), so that only a look before
// its reuse tells whether the origin closed it, or sent it bytes no request
// asked for, meanwhile. Its Probe closes a connection found unfit.
type prober interface{ Probe() error }

// fit reports whether mc, just taken from the pool, can carry a request;
// one that cannot leaves the pool. It runs outside mu: the look costs a
// system call, and may wait a few milliseconds for TLS records.
//
// Checking here rather than leaving RoundTrip to fail keeps a request off
// a connection the origin closed while it was idle whatever its method and
// body: a POST, or a body that cannot be sent twice, is not retried after
// ErrNoResponse (the origin may have got it), as under net/http, whose
// background read notices the close before the connection is reused.
func (t *mirroredTransport) fit(mc *mconn) bool {
	p, ok := mc.cc.(prober)
	if !ok {
		return true
	}
	if err := p.Probe(); err != nil {
		t.log.Debug("upstream connection not reused", "addr", mc.key.addr, "err", err)
		t.done(mc) // it cannot take a request now: removed and closed
		return false
	}
	return true
}

// hasH1Locked reports whether the origin answered key's hello with
// HTTP/1.1 on a connection still pooled. mu held.
func (t *mirroredTransport) hasH1Locked(key connKey) bool {
	for _, mc := range t.conns[key] {
		if !mc.h2 {
			return true
		}
	}
	return false
}

// open dials a new connection for key.
func (t *mirroredTransport) open(ctx context.Context, key connKey, fp *fingerprint.Fingerprint, gen uint64) (*mconn, error) {
	mc := &mconn{key: key, gen: gen}
	if !key.tls {
		c, err := t.dial(ctx, "tcp", key.addr)
		if err != nil {
			return nil, err
		}
		mc.cc = mirror.NewH1Conn(c, t.opts)
		return mc, nil
	}
	c, err := t.dialer.DialTLS(ctx, "tcp", key.addr, fp.Hello)
	if err != nil {
		return nil, stdTLSError(err)
	}
	rep := c.Report()
	t.hellos.add(rep.Mode)
	if rep.Mode != mirror.Mirrored || len(rep.Changes) > 0 {
		t.log.Debug("upstream connection hello differs from the client's", "hello", rep.Mode.String(),
			"addr", key.addr, "changes", rep.Changes, "failed", rep.Failed)
	}
	proto := c.ConnectionState().NegotiatedProtocol
	offered := t.dialer.TLSConfig.NextProtos // the Go hello's
	if fp.Hello != nil {
		offered = fp.Hello.ALPN
	}
	t.alpn.record(key.addr, offered, proto)
	cc, err := mirror.NewClientConn(c, proto, fp.H2, t.opts)
	if err != nil {
		c.Close()
		return nil, err
	}
	mc.cc, mc.h2 = cc, proto == "h2"
	return mc, nil
}

// stdTLSError gives a certificate failure of the mirror's TLS library the
// crypto/tls type that the proxy and the session health recognize (a bad
// certificate is the origin's, whatever the exit IP).
func stdTLSError(err error) error {
	var ue *utls.CertificateVerificationError
	if errors.As(err, &ue) {
		return &tls.CertificateVerificationError{UnverifiedCertificates: ue.UnverifiedCertificates, Err: err}
	}
	return err
}

// errHeaderTimeout ends a request whose response head did not come in
// time: a timeout (504) for the proxy, as net/http's is.
var errHeaderTimeout error = headerTimeoutError{}

type headerTimeoutError struct{}

func (headerTimeoutError) Error() string   { return "upstream: timeout awaiting response headers" }
func (headerTimeoutError) Timeout() bool   { return true }
func (headerTimeoutError) Temporary() bool { return true }

// send sends req on mc and ties the end of the response body to mc.
// headBounder is a connection that bounds the wait for a response head
// itself (HTTP/1.1, with a read deadline), sparing send its context and
// timer.
type headBounder interface {
	RoundTripWithin(*http.Request, time.Duration) (*http.Response, error)
}

func (t *mirroredTransport) send(mc *mconn, req *http.Request) (*http.Response, error) {
	out := connectionHeader(req, mc)
	if hb, ok := mc.cc.(headBounder); ok {
		resp, err := hb.RoundTripWithin(out, t.headerTimeout)
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) && req.Context().Err() == nil {
				err = errHeaderTimeout
			}
			return nil, err
		}
		if resp.Body == nil || resp.Body == http.NoBody {
			t.done(mc)
			return resp, nil
		}
		resp.Body = &mirroredBody{rc: resp.Body, finish: func() { t.done(mc) }}
		return resp, nil
	}
	ctx, cancel := context.WithCancelCause(req.Context())
	var resp *http.Response
	var err error
	var clock *headClock
	if t.headerTimeout > 0 {
		clock = &headClock{wait: t.headerTimeout, cancel: cancel}
	}
	if sn, ok := mc.cc.(sentNotifier); ok && clock != nil {
		// The wait starts once the request is all out, as net/http's:
		// an upload may take longer.
		resp, err = sn.RoundTripSent(out.WithContext(ctx), clock.start)
	} else {
		if clock != nil {
			clock.start()
		}
		resp, err = mc.cc.RoundTrip(out.WithContext(ctx))
	}
	timedOut := clock != nil && clock.stop()
	if err == nil && timedOut {
		resp.Body.Close()
		err = context.Canceled
	}
	if err != nil {
		if timedOut && errors.Is(context.Cause(ctx), errHeaderTimeout) && req.Context().Err() == nil {
			err = errHeaderTimeout
			t.shun(mc)
		}
		cancel(nil)
		return nil, err
	}
	finish := func() {
		cancel(nil)
		t.done(mc)
	}
	if resp.Body == nil || resp.Body == http.NoBody {
		finish()
		return resp, nil
	}
	resp.Body = &mirroredBody{rc: resp.Body, finish: finish}
	return resp, nil
}

// headClock bounds the wait for a response head over HTTP/2, from the
// moment the request is out (start), by cancelling the request's context
// with errHeaderTimeout.
type headClock struct {
	wait   time.Duration
	cancel context.CancelCauseFunc
	mu     sync.Mutex
	timer  *time.Timer
	ended  bool
}

func (c *headClock) start() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.timer == nil && !c.ended {
		c.timer = time.AfterFunc(c.wait, func() { c.cancel(errHeaderTimeout) })
	}
}

// stop ends the wait and reports whether it ran out first.
func (c *headClock) stop() (ranOut bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ended = true
	return c.timer != nil && !c.timer.Stop()
}

// sentNotifier is a connection that says when a request is all out
// (mirror.H2Conn.RoundTripSent).
type sentNotifier interface {
	RoundTripSent(req *http.Request, sent func()) (*http.Response, error)
}

// connectionHeader gives an HTTP/1.1 client's request going out over
// HTTP/1.1 its Connection field back, where the client had it and as the
// client spelled it: the proxy strips hop-by-hop fields, but an origin
// that sees a keep-alive client without its "Connection: keep-alive"
// (Python's requests sends it), or with "keep-alive" where it sent
// "Keep-Alive" (.NET), sees a client that does not exist.
//
// An HTTP/2 client's request translated to HTTP/1.1 (an origin that
// chose it) gets one only for its "TE: trailers" (Firefox, gRPC): over
// HTTP/1.1 a sender of TE must list it in Connection (RFC 9110 §10.1.4),
// and a TE without it is a request no HTTP/1.1 client sends. It goes
// after the client's fields, as "TE", the RFC's spelling.
func connectionHeader(req *http.Request, mc *mconn) *http.Request {
	shape := fingerprint.ShapeFrom(req.Context())
	if mc.h2 || shape == nil || req.Header.Get("Connection") != "" {
		return req
	}
	var v string
	switch {
	case shape.PseudoOrder != nil:
		if req.Header["Te"] == nil {
			return req
		}
		v = "TE"
	case req.ProtoMajor != 1 || !slices.ContainsFunc(shape.HeaderOrder, func(n string) bool { return strings.EqualFold(n, "Connection") }):
		return req
	default:
		v = connectionOptions(shape.Connection, req)
	}
	if v == "" {
		return req
	}
	out := *req
	out.Header = req.Header.Clone()
	out.Header.Set("Connection", v)
	return &out
}

// connectionOptions is the Connection value for a request whose client
// sent sent: its options that still hold for the origin connection
// (keep-alive, close, and TE when "TE: trailers" went on with the
// request), spelled as sent, the whole value as it was when all of them
// do. The others named fields the proxy removed (RFC 9110 §7.6.1). With
// none left it is "": no Connection field, as the client sends without
// those fields (curl's "Upgrade, HTTP2-Settings" for an h2c upgrade the
// proxy does not pass on). A "keep-alive" or "close" in its place was a
// field the client never sent; the connection's fate needs none, since
// the mirror reads it off the request (HTTP/1.0, Request.Close) itself.
func connectionOptions(sent string, req *http.Request) string {
	kept := make([]string, 0, 2)
	all := true
	for o := range strings.SplitSeq(sent, ",") {
		o = textproto.TrimString(o)
		switch {
		case o == "":
		case strings.EqualFold(o, "keep-alive"), strings.EqualFold(o, "close"),
			strings.EqualFold(o, "te") && req.Header["Te"] != nil:
			kept = append(kept, o)
		default:
			all = false
		}
	}
	if all {
		return sent
	}
	return strings.Join(kept, ", ")
}

// done releases one use of mc: an unused connection goes back to the pool
// (bounded, with its idle timer) or is closed.
func (t *mirroredTransport) done(mc *mconn) {
	t.mu.Lock()
	mc.active--
	if mc.active > 0 {
		t.mu.Unlock()
		return
	}
	if !t.keepAlive || t.closed || mc.gen != t.gen || mc.shunned || !mc.cc.CanTakeRequest() || !t.roomLocked(mc.key) {
		t.removeLocked(mc)
		t.mu.Unlock()
		mc.cc.Close()
		return
	}
	mc.idle = true
	t.nIdle++
	// One timer per connection, re-armed each time it goes idle: a new
	// one per request cost two allocations and a timer's setup. A stale
	// run (it fired as the connection was taken) finds it busy, or idle
	// again and closes it early, as a new timer's stale run would.
	if mc.timer == nil {
		mc.timer = time.AfterFunc(t.idleConnTimeout, func() { t.expire(mc) })
	} else {
		mc.timer.Reset(t.idleConnTimeout)
	}
	t.mu.Unlock()
}

// shun takes mc out of the choice for new requests: one of its requests
// timed out waiting for its head. Nothing else tells a silent HTTP/2
// connection (a NAT that forgot it, a peer that vanished) from a slow
// answer, and a silent one would be handed every request that follows,
// each costing a whole response_header_timeout, until the kernel gave up
// on it. Its streams under way go on; it closes with the last (done). A
// slow origin costs a new connection.
func (t *mirroredTransport) shun(mc *mconn) {
	t.mu.Lock()
	mc.shunned = true
	t.mu.Unlock()
}

// roomLocked reports whether the pool may keep one more idle connection
// for key. mu held.
func (t *mirroredTransport) roomLocked(key connKey) bool {
	if t.nIdle >= t.maxIdle {
		return false
	}
	n := 0
	for _, mc := range t.conns[key] {
		if mc.idle {
			n++
		}
	}
	return n < t.maxIdlePerHost
}

// expire closes mc after its idle timeout, unless it was taken meanwhile.
func (t *mirroredTransport) expire(mc *mconn) {
	t.mu.Lock()
	if !mc.idle || !slices.Contains(t.conns[mc.key], mc) {
		t.mu.Unlock()
		return
	}
	t.removeLocked(mc)
	t.mu.Unlock()
	mc.cc.Close()
}

// unidleLocked takes mc out of the idle count. mu held.
func (t *mirroredTransport) unidleLocked(mc *mconn) {
	if mc.idle {
		mc.idle = false
		t.nIdle--
		mc.timer.Stop()
	}
}

// removeLocked takes mc out of the pool. mu held.
func (t *mirroredTransport) removeLocked(mc *mconn) {
	t.unidleLocked(mc)
	list := slices.DeleteFunc(t.conns[mc.key], func(c *mconn) bool { return c == mc })
	if len(list) == 0 {
		delete(t.conns, mc.key)
	} else {
		t.conns[mc.key] = list
	}
}

// closeIdle retires every connection: the idle ones close now, the busy
// ones when their last request is done, and none is handed out again
// (after a rotation they lead to the old exit IP).
func (t *mirroredTransport) closeIdle() {
	t.mu.Lock()
	t.gen++
	var idle []*mconn
	for _, list := range t.conns {
		for _, mc := range list {
			if mc.active == 0 {
				idle = append(idle, mc)
			}
		}
	}
	for _, mc := range idle {
		t.removeLocked(mc)
	}
	t.mu.Unlock()
	closeAll(idle)
}

func closeAll(conns []*mconn) {
	for _, mc := range conns {
		mc.cc.Close()
	}
}

// close closes the idle connections and makes the transport refuse new
// requests; busy connections close when done.
func (t *mirroredTransport) close() {
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
	t.closeIdle()
}

// mirroredBody releases its connection's use at EOF, on an error or on
// Close, whichever comes first.
type mirroredBody struct {
	rc     io.ReadCloser
	once   sync.Once
	finish func()
}

func (b *mirroredBody) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	if err != nil {
		b.once.Do(b.finish)
	}
	return n, err
}

func (b *mirroredBody) Close() error {
	err := b.rc.Close()
	b.once.Do(b.finish)
	return err
}

// retryable reports whether a request that failed with err may be sent
// again on another connection: the origin certainly did not process it
// (mirror.ErrUnprocessed), or it went out on a reused connection that
// ended before any response (the origin closed it while idle; net/http
// retries those too), for a method that may be repeated. The body must be
// replayable either way.
func retryable(err error, reused bool, req *http.Request) bool {
	if req.Context().Err() != nil || !rewindable(req) {
		return false
	}
	if errors.Is(err, mirror.ErrUnprocessed) {
		return true
	}
	if !reused {
		return false
	}
	switch req.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
	default:
		if req.Header.Get("Idempotency-Key") == "" && req.Header.Get("X-Idempotency-Key") == "" {
			return false
		}
	}
	return errors.Is(err, mirror.ErrNoResponse)
}

func rewindable(req *http.Request) bool {
	return req.Body == nil || req.Body == http.NoBody || req.GetBody != nil
}

// rewind returns req with a fresh body for another attempt.
func rewind(req *http.Request) (*http.Request, error) {
	if req.Body == nil || req.Body == http.NoBody {
		return req, nil
	}
	body, err := req.GetBody()
	if err != nil {
		return nil, err
	}
	out := *req
	out.Body = body
	return &out, nil
}
