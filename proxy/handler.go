package proxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/elazarl/goproxy"

	"github.com/seed-a3c387e8/onceproxy/internal/bufpool"
	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/httpstatus"
	"github.com/seed-a3c387e8/onceproxy/internal/redact"
)

// headerSession lets a client pick its sticky upstream session per request
// without encoding it in the proxy user name; headerCountry its exit
// country. Never forwarded.
const (
	headerSession = "X-Onceproxy-Session"
	headerCountry = "X-Onceproxy-Country"
)

// identify is the front door's one rule for who a client is: the account
// and session hint its proxy user names, and the client the rate limit
// and the per-client flight cap count (its account when a user store
// verified it, else its address: the connection's, or with
// proxy.trust_forwarded_for the one the balancer reports in h; h is nil
// where no balancer can speak, on the SOCKS5 port). Without a user store
// a name is only a claim: counting by it would let a client escape its
// limits by sending a new name with each request. The error is a session
// hint the proxy cannot honour, for the client to hear about (400).
func (s *Server) identify(user, remoteAddr string, h http.Header) (clientinfo.Info, error) {
	u, err := clientinfo.ParseUser(user)
	if err != nil {
		return clientinfo.Info{}, err
	}
	counted := u.Account
	if s.users == nil {
		counted = ""
	}
	return clientinfo.Info{User: user, Account: u.Account, Session: u.Session, Country: u.Country, City: u.City,
		Client: clientinfo.ClientOf(counted, s.clientAddr(remoteAddr, h))}, nil
}

// clientAddr is the address of the client of a connection from
// remoteAddr: with proxy.trust_forwarded_for, the one the balancer
// reports in h (nil where no balancer can speak, on the SOCKS5 port).
func (s *Server) clientAddr(remoteAddr string, h http.Header) string {
	if s.cfg.TrustForwardedFor && h != nil {
		if addr := clientinfo.ForwardedFor(h); addr != "" {
			return addr
		}
	}
	return remoteAddr
}

// hintHeaders applies the X-Onceproxy-Session and X-Onceproxy-Country
// headers of h to info: they take precedence over the user name (a
// country other than the user name's drops its city). A value the proxy
// cannot honour is an error, never ignored.
func hintHeaders(info clientinfo.Info, h http.Header) (clientinfo.Info, error) {
	if v, ok, err := oneValue(h, headerSession, "name one session"); err != nil || ok {
		if err == nil {
			err = clientinfo.ValidateSessionID(v)
		}
		if err != nil {
			return info, fmt.Errorf("%s: %w (%w)", headerSession, err, clientinfo.ErrBadSession)
		}
		info.Session = v
	}
	if v, ok, err := oneValue(h, headerCountry, "name one country"); err != nil || ok {
		var c string
		if err == nil {
			c, err = clientinfo.ParseCountry(v)
		}
		if err != nil {
			return info, fmt.Errorf("%s: %w (%w)", headerCountry, err, clientinfo.ErrBadLocation)
		}
		if c != info.Country {
			info.Country, info.City = c, ""
		}
	}
	return info, nil
}

// firstValue is h.Get(name) for a canonical name, without canonicalizing
// it again.
func firstValue(h http.Header, name string) string {
	if vs := h[name]; len(vs) > 0 {
		return vs[0]
	}
	return ""
}

// oneValue returns the value of header name (canonical: it indexes the map
// as net/http filled it) in h, if it was sent once.
func oneValue(h http.Header, name, hint string) (v string, ok bool, err error) {
	vs := h[name]
	switch len(vs) {
	case 0:
		return "", false, nil
	case 1:
		return vs[0], true, nil
	}
	return "", false, fmt.Errorf("sent %d times; %s", len(vs), hint)
}

// badSession answers a session hint or an exit location the proxy cannot
// honour.
func badSession(req *http.Request, err error) *http.Response {
	kind := kindBadSession
	if errors.Is(err, clientinfo.ErrBadLocation) {
		kind = kindBadCountry
	}
	return errorResponse(req, http.StatusBadRequest, kind, err.Error())
}

// proxyUser extracts the user name of a Basic Proxy-Authorization header.
func proxyUser(h http.Header) string {
	user, _, _ := basicCredentials(h)
	return user
}

// handle is the one request handler of the proxy, for plain absolute-form
// requests and for every request decrypted inside a MITM'd tunnel, over
// HTTP/1.1 and HTTP/2 alike. It always returns a response: goproxy would
// answer a failure with a bare 500 carrying the raw error, so failures never
// leave this function as errors.
func (s *Server) handle(req *http.Request, _ *goproxy.ProxyCtx) (*http.Request, *http.Response) {
	return req, s.serve(req.Context(), req)
}

// serve answers req, whose context is ctx: req's own, or one the caller
// added values to (the tunnel's fingerprint). The request is copied once,
// with everything its context gained, on its way to the engine.
func (s *Server) serve(ctx context.Context, req *http.Request) (resp *http.Response) {
	start := time.Now()
	s.inflight.Add(1)
	// What the proxy knows of the client, learned once at the front door:
	// from the request itself, or from the CONNECT (or SOCKS5 handshake)
	// that opened its tunnel, which the request's context carries.
	var client clientinfo.Info
	inTunnel := false
	if t := tunnelFrom(ctx); t != nil {
		client, inTunnel = t.info, true
	}
	defer func() {
		if p := recover(); p != nil {
			s.logger.Error("panic while serving a request; recovered",
				"panic", p, "url", redact.ParsedURL(req.URL), "stack", string(debug.Stack()))
			resp = errorResponse(req, http.StatusInternalServerError, kindInternal,
				"internal error while serving this request")
		}
		resp = s.finish(req, resp, client.User, start)
	}()

	// Requests inside a tunnel were authenticated and identified on its
	// CONNECT; plain absolute-form requests carry their own credentials.
	if !inTunnel {
		user, refusal := s.authenticate(req)
		if refusal != nil {
			return refusal
		}
		info, err := s.identify(user, req.RemoteAddr, req.Header)
		if err != nil {
			return badSession(req, err)
		}
		if r := s.attribute(req, info); r != nil {
			return r
		}
		client = info
		// Its client's header order and case, for the upstream.
		ctx = plainShapeCtx(ctx, req)
	}
	if req.URL.Scheme != "http" && req.URL.Scheme != "https" {
		return errorResponse(req, http.StatusBadRequest, kindBadRequest,
			fmt.Sprintf("unsupported URL scheme %q: onceproxy forwards http and https", req.URL.Scheme))
	}
	host := req.URL.Hostname()
	if host == "" {
		return errorResponse(req, http.StatusBadRequest, kindBadRequest, "request URL has no host")
	}
	info, err := hintHeaders(client, req.Header)
	if err != nil {
		return badSession(req, err)
	}
	req.Header.Del(headerSession)
	req.Header.Del(headerCountry)
	if r := s.limit(ctx, req, info.Client, host); r != nil {
		return r
	}
	ctx, refused := s.checkTarget(ctx, req, host)
	if refused != nil {
		return refused
	}

	upgrade := isUpgrade(req.Header)
	removeRequestHopHeaders(req.Header, upgrade)
	if s.cfg.TrustForwardedFor {
		clientinfo.DropForwarded(req.Header) // read by clientAddr
	}
	req.RequestURI = ""
	req.Header.Del(headerProxyError)

	var body *clientBody
	if req.Body != nil && req.Body != http.NoBody {
		body = &clientBody{ReadCloser: req.Body}
		req.Body = body
	}
	next := s.next
	if upgrade {
		// A protocol switch is a live two-way stream: never deduplicated.
		next = s.upstream
	}
	up, err := next.RoundTrip(req.WithContext(clientinfo.With(ctx, info)))
	if err != nil && body != nil && body.failed() != nil {
		// The client's own body was malformed (a bad chunk, cut short):
		// its fault, not the upstream's.
		return errorResponse(req, http.StatusBadRequest, kindBadRequest,
			"malformed request body: "+body.failed().Error())
	}
	if err != nil {
		resp, status, kind := failureResponse(req, err)
		if kind == kindForbidden {
			// The dial-time guard: a name that resolved to a private
			// address.
			s.metrics.SSRFRefused()
		}
		s.logger.Warn("request failed", "url", redact.ParsedURL(req.URL), "status", status, "kind", kind, "err", redact.Text(err.Error()))
		return resp
	}
	if up.StatusCode == http.StatusSwitchingProtocols && !upgrade {
		// A switch the client never asked for (RFC 9110 §15.2.2 forbids
		// it): passed on, the client would take its connection for the
		// new protocol's while the proxy goes on speaking HTTP on it.
		up.Body.Close()
		s.logger.Warn("request failed", "url", redact.ParsedURL(req.URL), "status", http.StatusBadGateway,
			"kind", kindUpstream, "err", "the origin switched protocols on a request without Upgrade")
		return errorResponse(req, http.StatusBadGateway, kindUpstream,
			"the origin answered 101 Switching Protocols to a request that asked for no upgrade")
	}
	if up.StatusCode < 200 && up.StatusCode != http.StatusSwitchingProtocols || up.StatusCode > 999 {
		// Three digits the parser took (000, 099) or an interim status
		// as the final answer: no response a client can be given, and
		// writing it would panic in net/http.
		up.Body.Close()
		s.logger.Warn("request failed", "url", redact.ParsedURL(req.URL), "status", http.StatusBadGateway,
			"kind", kindUpstream, "err", fmt.Sprintf("the origin answered with status %d", up.StatusCode))
		return errorResponse(req, http.StatusBadGateway, kindUpstream,
			fmt.Sprintf("the origin answered with status %d, which is no final HTTP status", up.StatusCode))
	}
	if up.StatusCode != http.StatusSwitchingProtocols {
		removeHopHeaders(up.Header, false)
	}
	return up
}

// clientBody remembers the first error reading a client's request body,
// so that a failure it caused is answered as the client's (400), not as
// an upstream failure.
type clientBody struct {
	io.ReadCloser
	firstErr
}

func (b *clientBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	// A read after the transport closed the body says nothing about the
	// client's bytes.
	if err != nil && err != io.EOF && !errors.Is(err, http.ErrBodyReadAfterClose) {
		b.set(err)
	}
	return n, err
}

// firstErr keeps the first error set, for a body read on one goroutine
// and judged on another.
type firstErr struct {
	mu  sync.Mutex
	err error
}

func (f *firstErr) set(err error) {
	f.mu.Lock()
	if f.err == nil {
		f.err = err
	}
	f.mu.Unlock()
}

// failed returns the first error set, or nil.
func (f *firstErr) failed() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.err
}

// finish attaches the access log line and the in-flight accounting to the
// response body: both happen when goproxy closes the body after copying it
// to the client, so the line carries real byte counts and durations.
//
// It also makes a body that fails mid-way fail for the client. goproxy's
// copy (io.Copy into the ResponseWriter) only logs a read error and
// returns, and net/http then ends a chunked response with its last chunk,
// or an HTTP/2 stream with END_STREAM: a short body that looks complete.
// So a read error other than EOF aborts the handler instead
// (http.ErrAbortHandler, as httputil.ReverseProxy does): HTTP/1.1 clients
// see the connection cut before the promised length or the last chunk,
// HTTP/2 clients an RST_STREAM. Every body goproxy copies is read in the
// handler's goroutine, under net/http's recovery (the proxy port, and the
// inner server of intercepted tunnels); a 101's body is spliced in
// goroutines of goproxy's own, so it never aborts.
func (s *Server) finish(req *http.Request, resp *http.Response, user string, start time.Time) *http.Response {
	if resp.Body == nil {
		resp.Body = http.NoBody
	}
	var tb *trackedBody
	done := func(n int64) {
		s.inflight.Add(-1)
		// Read by their canonical names, straight from the map: this runs
		// once per request.
		xc := firstValue(resp.Header, headerCache)
		dur := time.Since(start)
		s.metrics.Request(xc, resp.StatusCode, dur)
		if !s.accessLog {
			return
		}
		attrs := []slog.Attr{
			slog.String("method", req.Method),
			slog.String("host", req.URL.Host),
			slog.Int("status", resp.StatusCode),
			slog.Int64("bytes", n),
			slog.Duration("dur", dur),
		}
		if xc != "" {
			attrs = append(attrs, slog.String("cache", xc))
		}
		if e := firstValue(resp.Header, headerProxyError); e != "" {
			attrs = append(attrs, slog.String("error", e))
		}
		if err := tb.failed(); err != nil {
			attrs = append(attrs, slog.String("body_error", err.Error()))
		}
		if user != "" {
			attrs = append(attrs, slog.String("user", user))
		}
		logAccess(req.Context(), s.logger, "request", attrs)
	}
	if rw, ok := resp.Body.(io.ReadWriteCloser); ok {
		// goproxy splices a 101 response's body as the upstream half of
		// the WebSocket: keep it writable.
		rb := &rwBody{trackedBody: trackedBody{ReadCloser: rw, done: done}, w: rw}
		tb, resp.Body = &rb.trackedBody, rb
	} else {
		tb = &trackedBody{ReadCloser: resp.Body, done: done, abort: true, size: resp.ContentLength}
		resp.Body = tb
	}
	return resp
}

// logAccess writes an access log line (request, tunnel) at Info. It
// builds the record itself, without the caller's program counter:
// slog.Logger.LogAttrs walks the stack for it on every call, for a source
// position that access lines never show (BenchmarkAccessLine in
// internal/logtext).
func logAccess(ctx context.Context, l *slog.Logger, msg string, attrs []slog.Attr) {
	h := l.Handler()
	if !h.Enabled(ctx, slog.LevelInfo) {
		return
	}
	r := slog.NewRecord(time.Now(), slog.LevelInfo, msg, 0)
	r.AddAttrs(attrs...)
	_ = h.Handle(ctx, r)
}

// flushingWriter is the ResponseWriter goproxy copies a response into:
// it flushes after every write, so bytes reach the client as they come
// from the origin (goproxy's io.Copy would leave them in net/http's
// buffers until a few KiB piled up, or the body ended). A write is what
// one Read of the body returned: a piece of the origin's stream as it
// arrives, or 32 KiB of a body already there, so the flushes cost no extra
// writes. It keeps the writer hijackable for WebSocket upgrades.
//
// A failed flush fails the write: the client is gone, and the copy from
// the origin stops there instead of reading on for nobody.
//
// net/http's writers (HTTP/1.1 and HTTP/2) and the lean loop's flush
// through FlushError directly; a ResponseController, which finds the
// flusher through Unwrap, is made only for a writer that has none (one
// allocation per request spared).
type flushingWriter struct {
	http.ResponseWriter
	flusher errFlusher               // w's own, when it has one
	rc      *http.ResponseController // otherwise

	// stream, with idle, is an HTTP/2 response's own write deadline (see
	// idleStream); moved is when it was last pushed forward.
	stream deadliner
	idle   time.Duration
	moved  time.Time
}

// deadliner is a response writer's write deadline (net/http's HTTP/2
// writer has one per stream; http.ResponseController looks for the same
// method).
type deadliner interface{ SetWriteDeadline(time.Time) error }

// idleStream gives an HTTP/2 response an idle write deadline: a write
// that has not gone through after idle fails and resets the stream. The
// connection's idle timeout (idleconn) cannot see a stream stalled by
// flow control: a client that never opens its window (WINDOW_UPDATE)
// while it keeps the connection busy (PINGs, other streams) held the
// handler, and its flight's body, for as long as it liked. The deadline
// is per stream, where net/http's HTTP/2 server keeps it, so the
// connection's other streams go on. An HTTP/1.x writer's stall is a
// blocked connection write, which idleconn already bounds.
func (w *flushingWriter) idleStream(idle time.Duration) {
	if d, ok := w.ResponseWriter.(deadliner); ok && idle > 0 {
		w.stream, w.idle = d, idle
	}
}

// moveDeadline pushes the stream's write deadline to idle from now before
// a write, at most once per quarter of idle (and per second): each one is
// a message to the connection's serving goroutine, as each of idleconn's
// refreshes is a poller call, and the slack is the same.
func (w *flushingWriter) moveDeadline() {
	if w.stream == nil {
		return
	}
	now := time.Now()
	if now.Sub(w.moved) < min(time.Second, w.idle/4) {
		return
	}
	w.moved = now
	_ = w.stream.SetWriteDeadline(now.Add(w.idle))
}

// errFlusher is a writer's flush that says whether it worked
// (http.ResponseController looks for the same method).
type errFlusher interface{ FlushError() error }

func streamTo(w http.ResponseWriter) *flushingWriter {
	if f, ok := w.(errFlusher); ok {
		return &flushingWriter{ResponseWriter: w, flusher: f}
	}
	return &flushingWriter{ResponseWriter: w, rc: http.NewResponseController(w)}
}

func (w *flushingWriter) flush() error {
	if w.flusher != nil {
		return w.flusher.FlushError()
	}
	return w.rc.Flush()
}

func (w *flushingWriter) Write(p []byte) (int, error) {
	w.moveDeadline()
	n, err := w.ResponseWriter.Write(p)
	if err == nil {
		err = w.flush()
	}
	return n, err
}

// writeLast writes the end of a body without a flush: the handler returns
// right after, and net/http sends what is buffered with the end of the
// response (over HTTP/2, one frame with END_STREAM instead of a flushed
// DATA frame and an empty one). The stream's deadline, moved here, still
// bounds that last send.
func (w *flushingWriter) writeLast(p []byte) (int, error) {
	w.moveDeadline()
	return w.ResponseWriter.Write(p)
}

func (w *flushingWriter) Flush() { _ = w.flush() }

func (w *flushingWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return http.NewResponseController(w.ResponseWriter).Hijack()
}

// Unwrap lets http.ResponseController reach the writer's own deadlines.
func (w *flushingWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// trackedBody counts the bytes read through it and reports once on Close.
// With abort, a read error other than EOF aborts the handler (see finish).
type trackedBody struct {
	io.ReadCloser
	n        atomic.Int64
	once     sync.Once
	done     func(n int64)
	abort    bool
	size     int64 // the body's length as announced; -1: unknown
	firstErr       // the first read error other than EOF
}

func (b *trackedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	if err != nil && err != io.EOF {
		b.set(err)
		if b.abort {
			// Close runs in goproxy's deferred Close, on the way out.
			panic(http.ErrAbortHandler)
		}
	}
	return n, err
}

// WriteTo copies the body to w with a pooled buffer: goproxy's io.Copy
// would allocate 32 KiB for every response otherwise. Each piece is
// written as it is read, so streaming is unchanged; the piece that ends
// the body is not flushed on its own (see writeLast).
func (b *trackedBody) WriteTo(w io.Writer) (int64, error) {
	bp := bufpool.Get()
	defer bufpool.Put(bp)
	fw, flushing := w.(*flushingWriter)
	var total int64
	for {
		n, err := b.Read(*bp)
		if n > 0 {
			var wn int
			var werr error
			if flushing && (err == io.EOF || b.size >= 0 && total+int64(n) == b.size) {
				wn, werr = fw.writeLast((*bp)[:n])
			} else {
				wn, werr = w.Write((*bp)[:n])
			}
			total += int64(wn)
			if werr != nil {
				return total, werr
			}
		}
		if err == io.EOF {
			return total, nil
		}
		if err != nil {
			return total, err
		}
	}
}

func (b *trackedBody) Close() error {
	err := b.ReadCloser.Close()
	b.once.Do(func() { b.done(b.n.Load()) })
	return err
}

type rwBody struct {
	trackedBody
	w io.Writer
}

func (b *rwBody) Write(p []byte) (int, error) { return b.w.Write(p) }

// forward serves a proxied request (absolute form, or a decrypted one
// completed to it) as goproxy's handleHttp would: handle's answer, its
// header, body and trailers written to w. It spares goproxy's per-request
// work the answer does not need: a context, the URL rendered for a debug
// line that is discarded, and a copy of every header value (the values are
// handed to net/http as they are: nothing writes into them, see
// dedup.Entry's). What goproxy does that this does not, it still does: a
// protocol switch (goproxy splices the two streams after the 101) and a
// request that is not in absolute form (its non-proxy handler).
func (s *Server) forward(w http.ResponseWriter, r *http.Request) {
	s.forwardCtx(r.Context(), w, r)
}

// forwardCtx is forward for a request whose context is ctx (see serve).
func (s *Server) forwardCtx(ctx context.Context, w http.ResponseWriter, r *http.Request) {
	if !r.URL.IsAbs() || isUpgrade(r.Header) {
		if ctx != r.Context() {
			r = r.WithContext(ctx)
		}
		s.gp.ServeHTTP(w, r)
		return
	}
	resp := s.serve(ctx, r)
	// Closed on the way out even when the copy aborts the handler (see
	// finish): the request's line is logged in Close.
	defer resp.Body.Close()
	h := w.Header()
	httpstatus.CopyHeader(h, resp.Header)
	// Trailers announced before the head commit net/http to chunked
	// encoding (HTTP/1.1) or a trailing HEADERS frame (HTTP/2), without
	// which they are dropped; as goproxy and httputil.ReverseProxy do.
	announced := len(resp.Trailer)
	if announced > 0 {
		names := make([]string, 0, announced)
		for k := range resp.Trailer {
			if httpstatus.TrailerAllowed(k) {
				names = append(names, k)
			}
		}
		if len(names) > 0 {
			h.Add("Trailer", strings.Join(names, ", "))
		}
	}
	w.WriteHeader(resp.StatusCode)
	_, _ = io.Copy(w, resp.Body)
	if len(resp.Trailer) == 0 {
		return
	}
	// Trailers the body's end added, beyond those announced, go out with
	// net/http's prefix after a flush that forces chunked encoding.
	_ = http.NewResponseController(w).Flush()
	for k, vs := range resp.Trailer {
		if !httpstatus.TrailerAllowed(k) {
			continue
		}
		if len(resp.Trailer) != announced {
			k = http.TrailerPrefix + k
		}
		h[k] = vs
	}
}
