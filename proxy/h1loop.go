package proxy

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/seed-a3c387e8/onceproxy/internal/connlimit"
	"github.com/seed-a3c387e8/onceproxy/internal/httpstatus"
	"github.com/seed-a3c387e8/onceproxy/internal/redact"
	"github.com/seed-a3c387e8/onceproxy/internal/workers"
)

// The HTTP/1.1 requests on the proxy port and inside intercepted tunnels
// are read and answered by a loop of the proxy's own (h1Conn) as long as
// they are plain: GET or HEAD, no body, no upgrade, no Expect, a head that
// fits the connection's read buffer and passes the checks net/http makes
// (on the proxy port, in absolute form). Those are nearly all of a
// scraper's requests, and net/http's server costs each of them a goroutine
// and a read to watch for the client leaving, six read deadlines and its
// response machinery: through net/http a cache hit took a quarter more CPU
// than through this loop, a unique miss a tenth more (onceload, https, 100
// hot keys and unique URLs, alternating rounds). The first request that is
// not plain hands the connection, with the bytes read ahead, to the
// http.Server of its door (the proxy port's: CONNECT, /fetch, bodies; the
// tunnels': HTTP/2 too), which serves it and everything after it: whatever
// the lean loop does not do, net/http still does, with the same limits.
//
// What a request's context promises is kept: it is cancelled when its
// response is done, or earlier when the client goes away. Watching for
// that takes a read that waits on the connection (net/http starts one for
// every request); here it starts only when something asks for the
// context's Done channel (a request that waits on a flight or goes
// upstream) and the request is still served watchAfter later, so a hit,
// or a miss answered at once, never pays for it.

// h1ReadSize is the lean loop's read buffer: a head that does not fit goes
// to net/http (which takes up to max_header_bytes).
const h1ReadSize = 4 << 10

// h1Loop is a lean loop's door: the connections it serves, what it
// answers, and where the rest goes.
type h1Loop struct {
	conns h1Conns
	// plain reports whether the loop answers req (see plainRequest).
	plain func(req *http.Request) bool
	// handle answers a plain request.
	handle func(w http.ResponseWriter, req *http.Request)
	// handOff gives a connection, its read-ahead in replay, to the door's
	// http.Server.
	handOff func(c *tappedConn)
	// base is the context of every request on c.
	base func(c *tappedConn) context.Context
}

// h1Conns are the connections a lean loop serves, for Shutdown.
type h1Conns struct {
	mu      sync.Mutex
	conns   map[*h1Conn]struct{}
	closing atomic.Bool // set under mu
	wg      sync.WaitGroup
	watches atomic.Int64 // started, for tests
}

// add registers h; false once Shutdown began.
func (hs *h1Conns) add(h *h1Conn) bool {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	if hs.closing.Load() {
		return false
	}
	if hs.conns == nil {
		hs.conns = make(map[*h1Conn]struct{})
	}
	hs.conns[h] = struct{}{}
	hs.wg.Add(1)
	return true
}

func (hs *h1Conns) remove(h *h1Conn) {
	hs.mu.Lock()
	delete(hs.conns, h)
	hs.mu.Unlock()
	hs.wg.Done()
}

// shutdown closes the idle connections and tells the busy ones to close
// after their response, then waits for them until ctx ends.
func (hs *h1Conns) shutdown(ctx context.Context) error {
	hs.mu.Lock()
	hs.closing.Store(true)
	for h := range hs.conns {
		h.closeIfIdle()
	}
	hs.mu.Unlock()
	return workers.Wait(ctx, &hs.wg)
}

func (hs *h1Conns) shuttingDown() bool { return hs.closing.Load() }

// h1Conn is one connection served by a lean loop.
type h1Conn struct {
	s    *Server
	loop *h1Loop
	c    *tappedConn
	br   *bufio.Reader
	base context.Context // every request's values
	addr string          // the client's address, every request's RemoteAddr
	// headBy is when the head being read must have arrived: the header
	// timeout, counted from the connection's start for its first request
	// and from the end of the one before for the others.
	headBy time.Time

	// idle is set while the loop waits for a request to begin, so that
	// Shutdown closes exactly the connections with nothing under way.
	mu   sync.Mutex
	idle bool

	// The watch for the client going away while a request is served
	// (see h1Ctx, startWatch), under wmu.
	wmu   sync.Mutex
	armed *h1Ctx        // the request whose Done was asked for, if any
	timer *time.Timer   // starts the watch watchAfter after arming
	watch chan struct{} // closed when the running watch is over
}

// serveH1 serves c's HTTP/1.1 requests with loop until the client is
// done, or hands c to loop's http.Server at the first request that is not
// plain.
func (s *Server) serveH1(loop *h1Loop, c *tappedConn) {
	h := &h1Conn{s: s, loop: loop, c: c, br: bufio.NewReaderSize(c, h1ReadSize), base: loop.base(c), addr: c.RemoteAddr().String()}
	if !loop.conns.add(h) {
		c.Close()
		return
	}
	defer loop.conns.remove(h)
	first := true
	for {
		switch h.serveOne(first) {
		case h1Again:
			first = false
		case h1HandOff:
			h.handOff()
			return
		case h1Close:
			c.Close()
			return
		}
	}
}

// What serveOne leaves the connection to.
type h1Next int

const (
	h1Again h1Next = iota
	h1HandOff
	h1Close
)

// serveOne reads and answers one request.
func (h *h1Conn) serveOne(first bool) h1Next {
	if !h.waitForRequest(first) {
		return h1Close
	}
	connlimit.SetBusy(h.c, true)
	defer connlimit.SetBusy(h.c, false)
	if !first {
		// A connection's first request has had its header timeout since
		// it opened, as net/http counts it.
		h.headBy = time.Now().Add(h.s.cfg.ReadHeaderTimeout)
		_ = h.c.SetReadDeadline(h.headBy)
	}
	n, ok := h.headLen()
	if !ok {
		// Too long for the buffer (net/http reads it, up to
		// max_header_bytes), or a blank line first.
		return h1HandOff
	}
	if n < 0 {
		return h1Close // the client left, or the header timeout passed
	}
	// What the buffer holds, the head first: replayed for net/http if
	// this request is not for the lean loop. Reading the head leaves it
	// in place: it is all buffered, so nothing refills the buffer.
	ahead, _ := h.br.Peek(h.br.Buffered())
	req, err := http.ReadRequest(h.br)
	if err != nil || !plainRequest(req, ahead[:n]) || !h.loop.plain(req) {
		h.c.replay = append([]byte(nil), ahead...)
		return h1HandOff
	}
	_ = h.c.SetReadDeadline(time.Time{})
	return h.serve(req)
}

// waitForRequest waits for the first byte of the next request, up to the
// idle timeout (the header timeout for a connection's first); false: the
// client is done, or Shutdown closed the connection, which counts as idle
// until a request begins.
func (h *h1Conn) waitForRequest(first bool) bool {
	h.setIdle(true)
	defer h.setIdle(false)
	if h.loop.conns.shuttingDown() {
		return false
	}
	if h.br.Buffered() > 0 {
		return true // pipelined
	}
	wait := h.s.cfg.IdleTimeout
	if first {
		wait = h.s.cfg.ReadHeaderTimeout
	}
	deadline := time.Now().Add(wait)
	if first {
		h.headBy = deadline
	}
	_ = h.c.SetReadDeadline(deadline)
	_, err := h.br.Peek(1)
	return err == nil
}

func (h *h1Conn) setIdle(idle bool) {
	h.mu.Lock()
	h.idle = idle
	h.mu.Unlock()
}

// closeIfIdle closes the connection when it waits for a request: Shutdown.
func (h *h1Conn) closeIfIdle() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.idle {
		h.c.Close()
	}
}

// headLen waits until the buffer holds a whole request head and returns
// its length, blank line included. ok is false when the head does not fit
// the buffer or begins with a blank line (net/http's to answer); n is -1
// when the connection failed first.
func (h *h1Conn) headLen() (n int, ok bool) {
	for {
		buf, _ := h.br.Peek(h.br.Buffered())
		switch end := headEnd(buf); {
		case end < 0:
			return 0, false
		case end > 0:
			return end, true
		}
		if h.br.Buffered() == h.br.Size() {
			return 0, false
		}
		// One byte more than we have: blocks until the next read. A
		// client that goes away or runs past the header timeout is
		// closed, as net/http closes it.
		if _, err := h.br.Peek(h.br.Buffered() + 1); err != nil {
			return -1, true
		}
	}
}

// headEnd is the length of the head at the start of b up to and including
// the empty line that ends it (CRLF or a bare LF, as net/http accepts), 0
// when b holds no whole head, or -1 when b begins with a blank line.
func headEnd(b []byte) int {
	start := 0
	for i, c := range b {
		if c != '\n' {
			continue
		}
		line := b[start:i]
		if len(line) == 0 || len(line) == 1 && line[0] == '\r' {
			if start == 0 {
				return -1 // a blank line before the request line: net/http's business
			}
			return i + 1
		}
		start = i + 1
	}
	return 0
}

// plainRequest reports whether req, read from head, is one the lean loop
// answers: what net/http would accept as is (one valid Host field, valid
// header fields), for HTTP/1.1, GET or HEAD, without a body, an upgrade or
// an Expect.
func plainRequest(req *http.Request, head []byte) bool {
	if req.ProtoMajor != 1 || req.ProtoMinor != 1 {
		return false
	}
	if req.Method != http.MethodGet && req.Method != http.MethodHead {
		return false
	}
	if req.ContentLength != 0 || len(req.TransferEncoding) > 0 || req.Body != http.NoBody {
		return false
	}
	// http.ReadRequest drops the Host field (an absolute-form request
	// takes its host from the URL): net/http's server checks the field
	// first, and so does this.
	if host, ok := hostField(head); !ok || !httpguts.ValidHostHeader(host) || req.Host == "" {
		return false
	}
	if isUpgrade(req.Header) {
		return false
	}
	if _, ok := req.Header["Expect"]; ok {
		return false
	}
	for k, vs := range req.Header {
		if !httpguts.ValidHeaderFieldName(k) {
			return false
		}
		for _, v := range vs {
			if !httpguts.ValidHeaderFieldValue(v) {
				return false
			}
		}
	}
	return true
}

// hostField returns the value of the Host field of head, a request head,
// and whether it has exactly one and no folded line. The value is trimmed
// as textproto trims it (spaces, tabs and the line's end; not the other
// Unicode spaces, which net/http then refuses). A folded line (obs-fold:
// it begins with a space or a tab) is textproto's to join to the field
// before it, which may be Host: net/http then judges the joined value.
func hostField(head []byte) (string, bool) {
	var host []byte
	n := 0
	first := true
	for line := range bytes.Lines(head) {
		if !first && (line[0] == ' ' || line[0] == '\t') {
			return "", false
		}
		first = false
		name, value, ok := bytes.Cut(line, []byte(":"))
		if !ok || !bytes.EqualFold(name, []byte("Host")) {
			continue
		}
		n++
		host = bytes.Trim(value, " \t\r\n")
	}
	return string(host), n == 1
}

// handOff gives the connection to the loop's http.Server, with what was
// read ahead.
func (h *h1Conn) handOff() {
	if h.c.replay == nil && h.br.Buffered() > 0 {
		ahead, _ := h.br.Peek(h.br.Buffered())
		h.c.replay = append([]byte(nil), ahead...)
	}
	_ = h.c.SetReadDeadline(time.Time{})
	// The head's timeout has been running since it began: net/http would
	// start one afresh, and a client sending a head slowly would get
	// nearly twice the time.
	h.c.headBy = h.headBy
	h.loop.handOff(h.c)
}

// serve answers req and says what comes next.
func (h *h1Conn) serve(req *http.Request) (next h1Next) {
	ctx := &h1Ctx{Context: h.base, h: h}
	req = req.WithContext(ctx)
	req.RemoteAddr = h.addr
	w := newH1Writer(h.c, req, &h.loop.conns)
	defer func() {
		ctx.cancel(context.Canceled)
		h.stopWatch()
		w.release()
	}()
	if aborted := h.run(w, req); aborted {
		return h1Close
	}
	if err := w.finish(); err != nil || w.closeAfter {
		return h1Close
	}
	return h1Again
}

// run calls the handler. A panic ends the connection: http.ErrAbortHandler
// (a body that failed mid-way, see finish in handler.go) quietly, anything
// else logged, as net/http does.
func (h *h1Conn) run(w *h1Writer, req *http.Request) (aborted bool) {
	defer func() {
		if p := recover(); p != nil {
			aborted = true
			if p != http.ErrAbortHandler {
				h.s.logger.Error("panic while serving a request; connection closed",
					"panic", p, "url", redact.ParsedURL(req.URL), "stack", string(debug.Stack()))
			}
		}
	}()
	h.loop.handle(w, req)
	return false
}

// watchAfter is how long after a request first asks for its context's
// Done channel (it waits on a flight, or goes upstream) the lean loop
// starts watching for its client going away: most answers come sooner (a
// hit, a miss from a fast origin) and never pay for the watch (a
// goroutine, a read, and two deadlines to end it); a client that leaves is
// noticed that much later at most.
const watchAfter = 100 * time.Millisecond

// armWatch has the watch start for ctx's request once it has been served
// for watchAfter.
func (h *h1Conn) armWatch(ctx *h1Ctx) {
	h.wmu.Lock()
	defer h.wmu.Unlock()
	h.armed = ctx
	if h.timer == nil {
		h.timer = time.AfterFunc(watchAfter, h.startWatch)
		return
	}
	h.timer.Reset(watchAfter)
}

// startWatch starts the read that cancels the armed request's context when
// its client goes away (EOF or an error). A pipelined next request it
// reads stays in the buffer.
func (h *h1Conn) startWatch() {
	h.wmu.Lock()
	defer h.wmu.Unlock()
	ctx := h.armed
	if ctx == nil || h.watch != nil {
		return // its request is over
	}
	done := make(chan struct{})
	h.watch = done
	h.loop.conns.watches.Add(1)
	go func() {
		defer close(done)
		// A deadline is stopWatch's past one (or the idle timeout's),
		// not the client leaving.
		if _, err := h.br.Peek(1); err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			ctx.cancel(context.Canceled)
		}
	}()
}

// stopWatch disarms the watch and ends it, if it runs, before the loop
// reads again: a read deadline in the past ends the read it waits in.
func (h *h1Conn) stopWatch() {
	h.wmu.Lock()
	h.armed = nil
	if h.timer != nil {
		h.timer.Stop()
	}
	w := h.watch
	h.watch = nil
	h.wmu.Unlock()
	if w == nil {
		return
	}
	_ = h.c.SetReadDeadline(time.Unix(1, 0))
	<-w
	_ = h.c.SetReadDeadline(time.Time{})
}

// h1Ctx is a lean request's context: the connection's values, and a Done
// channel made on first use, which arms the watch for the client going
// away. It implements AfterFunc, so contexts derived from it register with
// it instead of starting a goroutine each.
type h1Ctx struct {
	context.Context // values only: never done
	h               *h1Conn

	mu     sync.Mutex
	done   chan struct{}
	err    error
	afters map[*h1After]struct{}
}

type h1After struct{ f func() }

func (x *h1Ctx) Done() <-chan struct{} {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.done == nil {
		x.done = make(chan struct{})
		if x.err != nil {
			close(x.done)
		} else {
			x.h.armWatch(x)
		}
	}
	return x.done
}

func (x *h1Ctx) Err() error {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.err
}

// AfterFunc runs f once x is cancelled; stop unregisters it (see
// context.AfterFunc).
func (x *h1Ctx) AfterFunc(f func()) (stop func() bool) {
	a := &h1After{f: f}
	x.mu.Lock()
	if x.err != nil {
		x.mu.Unlock()
		go f()
		return func() bool { return false }
	}
	if x.afters == nil {
		x.afters = make(map[*h1After]struct{})
	}
	x.afters[a] = struct{}{}
	x.mu.Unlock()
	return func() bool {
		x.mu.Lock()
		defer x.mu.Unlock()
		if _, ok := x.afters[a]; !ok {
			return false
		}
		delete(x.afters, a)
		return true
	}
}

func (x *h1Ctx) cancel(err error) {
	x.mu.Lock()
	if x.err != nil {
		x.mu.Unlock()
		return
	}
	x.err = err
	if x.done != nil {
		close(x.done)
	}
	afters := x.afters
	x.afters = nil
	x.mu.Unlock()
	for a := range afters {
		go a.f()
	}
}

// h1Writer is the lean loop's http.ResponseWriter (and http.Flusher): the
// head as net/http writes it (status line, sorted fields, a Date when the
// handler set none), then the body with the Content-Length the handler
// set, else chunked, trailers included.
type h1Writer struct {
	bw     *bufio.Writer // nil once released
	req    *http.Request
	header http.Header
	conns  *h1Conns // its loop's: a shutdown closes the connection after the response

	wroteHeader bool
	noBody      bool // HEAD, 1xx, 204, 304
	chunked     bool
	closeAfter  bool  // Connection: close, or a body that cannot end cleanly
	declared    int64 // Content-Length, -1 unknown
	written     int64
	err         error // the first write error; the response is lost
}

var h1Writers = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, 4<<10) }}

func newH1Writer(conn io.Writer, req *http.Request, conns *h1Conns) *h1Writer {
	bw := h1Writers.Get().(*bufio.Writer)
	bw.Reset(conn)
	return &h1Writer{bw: bw, req: req, header: make(http.Header), conns: conns, declared: -1, closeAfter: req.Close}
}

// release gives the buffer back: the response is over, and a handler
// that writes to it afterwards gets errAfterResponse.
func (w *h1Writer) release() {
	w.bw.Reset(nil)
	h1Writers.Put(w.bw)
	w.bw = nil
	if w.err == nil {
		w.err = errAfterResponse
	}
}

var errAfterResponse = errors.New("proxy: write after the response ended")

func (w *h1Writer) Header() http.Header { return w.header }

func (w *h1Writer) WriteHeader(code int) {
	if w.wroteHeader || w.err != nil {
		return
	}
	checkWriteHeaderCode(code)
	if code < 200 && code != http.StatusSwitchingProtocols {
		// Informational: its own head, then the final one.
		w.writeHead(code, w.header)
		return
	}
	w.wroteHeader = true
	h := w.header
	w.noBody = w.req.Method == http.MethodHead || !httpstatus.BodyAllowed(code)
	if !httpstatus.BodyAllowed(code) {
		// As net/http answers them: RFC 9110 forbids a length on a 204,
		// and a 304's length and type describe a body that is not there.
		h.Del("Content-Length")
		h.Del("Transfer-Encoding")
		if code == http.StatusNotModified {
			h.Del("Content-Type")
		}
	}
	if cl := h.Get("Content-Length"); cl != "" {
		if n, err := strconv.ParseInt(cl, 10, 64); err == nil && n >= 0 {
			w.declared = n
		} else {
			h.Del("Content-Length")
		}
	}
	if _, ok := h["Trailer"]; ok && !w.noBody {
		// Trailers need chunks.
		w.declared = -1
		h.Del("Content-Length")
	}
	if !w.noBody && w.declared < 0 {
		w.chunked = true
		h["Transfer-Encoding"] = []string{"chunked"}
	}
	// In a shutdown the response says the connection closes after it, as
	// net/http's does.
	if headerHasToken(h, "Connection", "close") || w.conns.shuttingDown() {
		w.closeAfter = true
	}
	if w.closeAfter {
		h["Connection"] = []string{"close"}
	}
	if _, ok := h["Date"]; !ok {
		h["Date"] = []string{time.Now().UTC().Format(http.TimeFormat)}
	}
	w.writeHead(code, h)
}

func (w *h1Writer) writeHead(code int, h http.Header) {
	w.bw.WriteString("HTTP/1.1 ")
	w.bw.WriteString(httpstatus.Line(code))
	w.bw.WriteString("\r\n")
	// Trailer fields set before the head go out at the end.
	var omit map[string]bool
	for k := range h {
		if strings.HasPrefix(k, http.TrailerPrefix) {
			if omit == nil {
				omit = make(map[string]bool)
			}
			omit[k] = true
		}
	}
	if err := h.WriteSubset(w.bw, omit); err != nil {
		w.err = err
	}
	if _, err := w.bw.WriteString("\r\n"); err != nil && w.err == nil {
		w.err = err
	}
}

func (w *h1Writer) Write(p []byte) (int, error) {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if w.err != nil {
		return 0, w.err
	}
	if w.noBody {
		if w.req.Method == http.MethodHead {
			return len(p), nil
		}
		return 0, http.ErrBodyNotAllowed
	}
	if w.declared >= 0 && w.written+int64(len(p)) > w.declared {
		w.closeAfter = true
		p = p[:w.declared-w.written]
		n, _ := w.bw.Write(p)
		w.written += int64(n)
		return n, http.ErrContentLength
	}
	if len(p) == 0 {
		return 0, nil
	}
	var n int
	var err error
	if w.chunked {
		w.bw.WriteString(strconv.FormatInt(int64(len(p)), 16))
		w.bw.WriteString("\r\n")
		n, err = w.bw.Write(p)
		if err == nil {
			_, err = w.bw.WriteString("\r\n")
		}
	} else {
		n, err = w.bw.Write(p)
	}
	w.written += int64(n)
	if err != nil {
		w.err = err
	}
	return n, err
}

// Flush sends what is buffered, the head included.
func (w *h1Writer) Flush() { _ = w.FlushError() }

// FlushError is Flush, with the error that lost the response, if any.
func (w *h1Writer) FlushError() error {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if w.err == nil {
		w.err = w.bw.Flush()
	}
	return w.err
}

// checkWriteHeaderCode panics on a status no response can carry, as
// net/http's writers do.
func checkWriteHeaderCode(code int) {
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code))
	}
}

// finish ends the response: the last chunk and the trailers, or a
// Content-Length of 0 for a handler that wrote nothing, as net/http
// answers; then it flushes. A body shorter than declared cannot end the
// response cleanly: the connection closes.
func (w *h1Writer) finish() error {
	if !w.wroteHeader {
		if _, ok := w.header["Content-Length"]; !ok {
			w.header["Content-Length"] = []string{"0"}
		}
		w.WriteHeader(http.StatusOK)
	}
	if w.err != nil {
		return w.err
	}
	if w.chunked {
		w.bw.WriteString("0\r\n")
		w.writeTrailers()
		w.bw.WriteString("\r\n")
	}
	if w.declared >= 0 && w.written < w.declared && !w.noBody {
		w.closeAfter = true
	}
	return w.bw.Flush()
}

// writeTrailers writes the fields announced in Trailer and those set with
// http.TrailerPrefix, as net/http does.
func (w *h1Writer) writeTrailers() {
	t := make(http.Header)
	for _, names := range w.header["Trailer"] {
		for _, k := range strings.Split(names, ",") {
			k = http.CanonicalHeaderKey(strings.TrimSpace(k))
			if vs, ok := w.header[k]; ok && k != "" {
				t[k] = vs
			}
		}
	}
	for k, vs := range w.header {
		if name, ok := strings.CutPrefix(k, http.TrailerPrefix); ok {
			t[http.CanonicalHeaderKey(name)] = vs
		}
	}
	_ = t.Write(w.bw)
}
