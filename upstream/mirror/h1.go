package mirror

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
)

// Options tunes a client connection. The zero value is ready to use.
type Options struct {
	// ExpectContinueTimeout is how long a request with "Expect:
	// 100-continue" waits for the go-ahead before sending its body anyway.
	// If zero, 1 second.
	ExpectContinueTimeout time.Duration
	// MaxResponseHeaderBytes bounds a response's header section.
	// If zero, 1 MiB.
	MaxResponseHeaderBytes int64
	// WriteTimeout bounds each write to the connection; a peer that stops
	// reading fails the connection after it. If zero, 30 seconds.
	WriteTimeout time.Duration
	// PingTimeout is how long an HTTP/2 connection may have read nothing
	// before its next request goes out behind a PING, and how long the
	// PING then has to bring something back. A connection a NAT or a
	// proxy gateway dropped without a word takes writes and answers
	// nothing: without the PING, the request on it would wait for the
	// whole response-header timeout. Silent past it, the connection is
	// closed and its requests without a response fail with ErrNoResponse,
	// to be sent again on a new one. Chromium's "preface PING" works the
	// same way, with 10 seconds for both. If zero, 10 seconds; negative
	// turns it off.
	PingTimeout time.Duration
}

func (o Options) pingTimeout() time.Duration {
	if o.PingTimeout == 0 {
		return 10 * time.Second
	}
	return o.PingTimeout
}

func (o Options) expectTimeout() time.Duration {
	if o.ExpectContinueTimeout > 0 {
		return o.ExpectContinueTimeout
	}
	return time.Second
}

func (o Options) maxHeaderBytes() int64 {
	if o.MaxResponseHeaderBytes > 0 {
		return o.MaxResponseHeaderBytes
	}
	return 1 << 20
}

func (o Options) writeTimeout() time.Duration {
	if o.WriteTimeout > 0 {
		return o.WriteTimeout
	}
	return 30 * time.Second
}

// ErrUnprocessed wraps the error of a request the origin certainly did not
// process (the connection was gone, or refused the stream): it is safe to
// send it again on another connection, whatever its method.
var ErrUnprocessed = errors.New("mirror: request not processed")

// ErrNoResponse wraps the error of a request whose connection ended
// before a single byte of the response: on a reused connection, the origin
// most likely closed it while it was idle, before the request arrived (a
// caller may send a request that can be repeated again on a new
// connection, as net/http does).
var ErrNoResponse = errors.New("mirror: connection closed before any response")

// errBusy means a caller sent a second request on an HTTP/1.1 connection
// before the first one's response was read: a pool bug.
var errBusy = errors.New("mirror: HTTP/1.1 connection is busy")

// A ClientConn sends requests on one origin connection.
type ClientConn interface {
	RoundTrip(*http.Request) (*http.Response, error)
	// CanTakeRequest reports whether a request sent now would be taken:
	// the connection is open, not draining, and has room (HTTP/1.1: idle;
	// HTTP/2: a free stream).
	CanTakeRequest() bool
	Close() error
}

// NewClientConn starts HTTP on c, an established connection to the origin
// (normally a [Conn]): HTTP/2 when proto, the protocol ALPN chose, is "h2",
// else HTTP/1.1. pre is the client's HTTP/2 preface to mirror (nil: a
// default one); it is not used for HTTP/1.1.
func NewClientConn(c net.Conn, proto string, pre *fingerprint.H2, opts Options) (ClientConn, error) {
	switch proto {
	case "h2":
		return NewH2Conn(c, pre, opts)
	case "", "http/1.1", "http/1.0":
		return NewH1Conn(c, opts), nil
	}
	return nil, fmt.Errorf("mirror: the origin chose protocol %q, which the proxy does not speak", proto)
}

// An H1Conn sends HTTP/1.1 requests on one connection, one at a time,
// with their header fields in the client's order and case.
//
// Nothing reads the connection between requests, so nothing sees the
// origin close it, or send bytes no request asked for, while it is idle:
// a request on a connection that served one before first checks it (see
// [H1Conn.Probe]).
type H1Conn struct {
	conn net.Conn
	lr   *limitReader
	br   *bufio.Reader
	bw   *bufio.Writer
	opts Options

	// sock is the socket under conn, under TLS and wrappers, for the
	// check of an idle connection; nil when there is none to reach.
	sock syscall.RawConn
	// records: conn is a TLS layer over sock, which takes records of its
	// own (session tickets, key updates) off the socket on a read.
	records bool
	// direct: conn is the socket itself, with nothing above it that
	// could hold bytes already read from it.
	direct  bool
	scratch [1]byte // the idle check's reads
	peek    *peeker // the idle check's look at sock, made once

	mu      sync.Mutex // protects the fields below
	busy    bool       // a request is in flight (its response body unread), or a probe
	broken  bool       // closed, or in a state another request cannot follow
	used    bool       // a response ended with the connection kept: a next request reuses it
	checked bool       // Probe found the idle connection fit since its last response
}

// NewH1Conn wraps c, an established connection to the origin.
func NewH1Conn(c net.Conn, opts Options) *H1Conn {
	lr := &limitReader{r: c, n: -1}
	cc := &H1Conn{conn: c, lr: lr, br: bufio.NewReader(lr), bw: bufio.NewWriter(c), opts: opts}
	cc.sock, cc.records, cc.direct = socketOf(c)
	if cc.sock != nil {
		cc.peek = newPeeker()
	}
	return cc
}

// CanTakeRequest reports whether the connection is open and idle. It looks
// at no socket (a pool calls it under its lock): whether the origin closed
// an idle connection, or sent it bytes, is [H1Conn.Probe]'s to find out.
func (cc *H1Conn) CanTakeRequest() bool {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	return !cc.busy && !cc.broken
}

// Close closes the connection; a response body being read fails.
func (cc *H1Conn) Close() error {
	cc.mu.Lock()
	cc.broken = true
	cc.mu.Unlock()
	return cc.conn.Close()
}

func (cc *H1Conn) fail() {
	cc.mu.Lock()
	cc.broken, cc.busy = true, false
	cc.mu.Unlock()
	abort(cc.conn)
}

// abort closes c at once. A TLS connection's Close first sends
// close_notify, and an origin quick to answer that with the rest of a
// response could still get it read; closing the transport under the TLS
// session first leaves nothing to read.
func abort(c net.Conn) {
	if nc, ok := c.(interface{ NetConn() net.Conn }); ok {
		nc.NetConn().Close()
	}
	c.Close()
}

// errUnsolicited means the origin sent bytes on an idle connection: its
// framing and ours disagree, and the bytes would be read as the next
// request's answer. net/http logs "Unsolicited response received on idle
// HTTP channel" and drops the connection.
var errUnsolicited = errors.New("the origin sent bytes on the idle connection")

// recordWait bounds the read that lets the TLS layer take records that
// arrived on an idle connection. Only a record of the TLS layer's own
// (NewSessionTicket, KeyUpdate) makes the read wait this long; data, a
// close_notify or the end of the connection return at once.
const recordWait = 5 * time.Millisecond

// Probe checks that the idle connection can still take a request: the
// origin has not closed it (a FIN or a close_notify while it was idle),
// and has sent nothing since the last response. A connection found unfit
// is closed, and the error wraps ErrUnprocessed.
//
// The check costs one system call (a recv that peeks at the socket,
// without waiting): a Go socket is non-blocking, and a read with a
// deadline already past would not reach the socket at all (the runtime's
// poller fails it first). Only when TLS records arrived on the idle
// connection does it wait, up to a few milliseconds, for the TLS layer to
// read them: a session ticket or a key update leaves the connection fit.
//
// RoundTrip runs the same check on a connection that served a request
// before, unless a Probe passed since: a pool probes a connection before
// it commits a request to it (one whose body cannot be sent twice must
// not go out on a dead connection), and the request pays for one check.
func (cc *H1Conn) Probe() error {
	cc.mu.Lock()
	switch {
	case cc.broken:
		cc.mu.Unlock()
		return fmt.Errorf("mirror: connection closed: %w", ErrUnprocessed)
	case cc.busy:
		cc.mu.Unlock()
		return errBusy
	}
	cc.busy = true // no request reads the connection meanwhile
	cc.mu.Unlock()
	err := cc.idleCheck()
	cc.mu.Lock()
	cc.busy = false
	cc.checked = err == nil
	cc.broken = cc.broken || err != nil
	cc.mu.Unlock()
	if err != nil {
		abort(cc.conn)
		return fmt.Errorf("mirror: %w: %w", err, ErrUnprocessed)
	}
	return nil
}

// idleCheck looks for what arrived on the idle connection since the last
// response. It returns nil when nothing did.
func (cc *H1Conn) idleCheck() error {
	if cc.br.Buffered() > 0 {
		return errUnsolicited
	}
	if !cc.direct {
		// The layers over the socket may hold bytes already read off it:
		// TLS records read ahead, a tunnel's read-ahead. A read with a
		// deadline already past hands those out, and lets TLS go through
		// whole records it holds, without a system call; it never reaches
		// the socket, hence the peek below. The mirror's own TLS
		// connections do the same without touching the deadline.
		if err := cc.readHeld(); err != nil {
			return err
		}
	}
	if cc.sock == nil {
		return nil // no socket to look at: nothing more to know
	}
	for range 3 {
		pending, err := cc.peek.look(cc.sock)
		if err != nil {
			return fmt.Errorf("the origin closed the idle connection: %w", err)
		}
		if !pending {
			return nil
		}
		if !cc.records {
			return errUnsolicited
		}
		// TLS records arrived: data, a close_notify, or records of the
		// TLS layer's own, which its Read consumes and reads on past
		// (utls's, like crypto/tls's, returns only with application
		// data, an alert or an error). A short read tells them apart.
		if err := cc.readIdle(time.Now().Add(recordWait)); err != nil {
			return err
		}
		// The records were the TLS layer's own, or the deadline passed
		// before the read reached the socket: look again.
	}
	// Bytes keep coming that the TLS layer leaves on the socket: the
	// connection is in no state to bet a request on.
	return errUnsolicited
}

// recordHolder is the mirror's TLS connection ([Conn]): it hands out what
// its TLS layer holds without reading the socket, and knows whether its
// reads off the socket stopped inside a record.
type recordHolder interface {
	readHeld(p []byte) (int, error)
	midRecord() bool
}

// readHeld reads what the layers over the socket hold, without waiting:
// data means unsolicited bytes, a timeout nothing held, and anything else
// the connection's end.
func (cc *H1Conn) readHeld() error {
	h, ok := cc.conn.(recordHolder)
	if !ok {
		return cc.readIdle(time.Unix(1, 0))
	}
	return cc.idleRead(h.readHeld(cc.scratch[:]))
}

// readIdle reads the idle connection with the read deadline at d, then
// clears the deadline. Data means unsolicited bytes, a timeout nothing to
// read, and anything else the connection's end.
func (cc *H1Conn) readIdle(d time.Time) error {
	if err := cc.conn.SetReadDeadline(d); err != nil {
		return fmt.Errorf("the idle connection failed: %w", err)
	}
	if err := cc.idleRead(cc.conn.Read(cc.scratch[:])); err != nil {
		return err
	}
	if err := cc.conn.SetReadDeadline(time.Time{}); err != nil {
		return fmt.Errorf("the idle connection failed: %w", err)
	}
	return nil
}

// idleRead says what a read of an idle connection that may not wait
// found: data is unsolicited, a timeout is nothing, and any other error
// is the connection's end. Nothing read, but the TLS layer left holding
// the start of a record (the read took it off the socket, out of the
// peek's sight, and gave up waiting for the rest), is unsolicited too: no
// request can be answered behind it.
func (cc *H1Conn) idleRead(n int, err error) error {
	if n > 0 {
		return errUnsolicited
	}
	if err != nil && !timedOut(err) {
		return fmt.Errorf("the origin closed the idle connection: %w", err)
	}
	if h, ok := cc.conn.(recordHolder); ok && h.midRecord() {
		return errUnsolicited
	}
	return nil
}

// timedOut reports whether err is a read deadline's. Its own function: the
// net.Error that errors.As fills escapes, and declared in readIdle it cost
// every request on a reused connection an allocation, error or not.
func timedOut(err error) bool {
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return true
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// socketOf finds the socket under c: under a TLS layer (NetConn, as
// [Conn] and crypto/tls have it; records is then true) and wrappers that
// say what they wrap (Unwrap, as the proxy's idle-timeout and read-ahead
// wrappers do). direct means c is the socket itself.
func socketOf(c net.Conn) (sock syscall.RawConn, records, direct bool) {
	for depth := 0; depth < 16 && c != nil; depth++ {
		if sc, ok := c.(syscall.Conn); ok {
			rc, err := sc.SyscallConn()
			if err != nil {
				return nil, records, false
			}
			return rc, records, depth == 0
		}
		switch u := c.(type) {
		case interface{ NetConn() net.Conn }:
			c, records = u.NetConn(), true
		case interface{ Unwrap() net.Conn }:
			c = u.Unwrap()
		default:
			return nil, records, false
		}
	}
	return nil, records, false
}

// msgPeek is MSG_PEEK, the same value on every system with recv(2).
const msgPeek = 0x2

// A peeker looks at a socket without consuming anything or waiting. It
// is made once per connection: the function RawConn.Control calls, and
// what it answers, would otherwise be three allocations per request.
type peeker struct {
	n   int
	err error
	b   [1]byte
	fn  func(fd uintptr)
}

func newPeeker() *peeker {
	p := &peeker{}
	p.fn = func(fd uintptr) { p.n, p.err = recvfrom(syscall.Recvfrom, fd, p.b[:], msgPeek) }
	return p
}

// look reports whether the socket has bytes to read (pending), has ended
// (err: io.EOF, a reset), or neither. Go's sockets are non-blocking, so
// recv returns EAGAIN at once when nothing arrived. Control, unlike Read,
// ignores the read deadline. Where recv cannot look (Windows, js, wasip1)
// nothing is known.
func (p *peeker) look(sock syscall.RawConn) (pending bool, err error) {
	if err := sock.Control(p.fn); err != nil {
		return false, err // closed here
	}
	n, rerr := p.n, p.err
	switch {
	case rerr == nil && n > 0:
		return true, nil
	case rerr == nil:
		return false, io.EOF
	case errors.Is(rerr, syscall.EAGAIN), errors.Is(rerr, syscall.EINTR), // EWOULDBLOCK is EAGAIN on Unix
		errors.Is(rerr, errors.ErrUnsupported):
		return false, nil
	}
	return false, os.NewSyscallError("recvfrom", rerr)
}

// recvfrom calls syscall.Recvfrom, whose descriptor is an int on Unix and
// a Handle on Windows: the type parameter spares a file per system.
func recvfrom[FD ~int | ~uintptr](recv func(FD, []byte, int) (int, syscall.Sockaddr, error), fd uintptr, p []byte, flags int) (int, error) {
	n, _, err := recv(FD(fd), p, flags)
	return n, err
}

// RoundTrip sends req and reads the response head. The header fields go
// out in the order of the request context's [fingerprint.Shape]; Host and
// the body framing (Content-Length, or chunked for a body of unknown
// length) are written where the client had them. The body must be read to
// EOF or closed; a connection whose body was closed early is closed.
func (cc *H1Conn) RoundTrip(req *http.Request) (*http.Response, error) {
	return cc.RoundTripWithin(req, 0)
}

// RoundTripWithin is RoundTrip with the wait for the response head bounded
// by d (0: unbounded) with a read deadline on the connection: no timer or
// context per request. The wait starts once the request is written, its
// body included, as net/http's ResponseHeaderTimeout: an upload may take
// longer. Past d it fails with an error that matches
// os.ErrDeadlineExceeded, and the connection is closed.
func (cc *H1Conn) RoundTripWithin(req *http.Request, d time.Duration) (*http.Response, error) {
	closeBody := func() {
		if req.Body != nil {
			req.Body.Close()
		}
	}
	cc.mu.Lock()
	switch {
	case cc.broken:
		cc.mu.Unlock()
		closeBody()
		return nil, fmt.Errorf("mirror: connection closed: %w", ErrUnprocessed)
	case cc.busy:
		cc.mu.Unlock()
		closeBody()
		return nil, errBusy
	}
	cc.busy = true
	check := cc.used && !cc.checked
	cc.checked = false
	cc.mu.Unlock()

	if check {
		if err := cc.idleCheck(); err != nil {
			// Nothing of the request went out: a caller may send it
			// again on another connection, whatever its method.
			closeBody()
			cc.fail()
			return nil, fmt.Errorf("mirror: %w: %w", err, ErrUnprocessed)
		}
	}
	body, head, err := cc.head(req)
	if err != nil {
		closeBody()
		cc.mu.Lock()
		cc.busy = false
		cc.mu.Unlock()
		return nil, err
	}
	ctx := req.Context()
	// A cancelled request cannot be resumed on this connection: closing
	// it ends every read and write at once.
	stop := context.AfterFunc(ctx, cc.fail)

	expect := body != nil && strings.EqualFold(req.Header.Get("Expect"), "100-continue")
	w := &h1Write{done: make(chan struct{}), goOn: make(chan bool, 1)}
	if body == nil {
		// A head alone fits the socket's buffer: writing it here spares
		// a goroutine per request. A body goes alongside the read, for
		// origins that answer before they have read it all.
		cc.write(w, head, nil, nil, false)
		if d > 0 {
			cc.conn.SetReadDeadline(time.Now().Add(d))
		}
	} else {
		// The wait for the head starts once the body is out (the
		// writer starts it): an upload may take longer than d.
		w.headWait = d
		go cc.write(w, head, body, req.Trailer, expect)
	}

	resp, err := cc.readResponse(req, w, expect)
	if d > 0 && err == nil {
		if body == nil {
			cc.conn.SetReadDeadline(time.Time{})
		} else {
			w.headRead(cc.conn)
		}
	}
	if err != nil {
		stop()
		cc.fail()
		w.decide(false) // a writer waiting for 100 Continue gives up
		<-w.done
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if w.err != nil && !w.wrote {
			return nil, fmt.Errorf("mirror: write request: %v: %w", w.err, ErrUnprocessed)
		}
		return nil, err
	}
	b := &h1Body{cc: cc, rc: resp.Body, w: w, stop: stop,
		reuse: !resp.Close && !req.Close && resp.StatusCode != http.StatusSwitchingProtocols &&
			!(http10(req) && !httpguts.HeaderValuesContainsToken(req.Header["Connection"], "keep-alive"))}
	if resp.StatusCode == http.StatusSwitchingProtocols {
		// The connection now belongs to the response: what it carries is
		// no longer HTTP.
		stop()
		cc.mu.Lock()
		cc.broken = true
		cc.mu.Unlock()
		resp.Body = &switched{br: cc.br, conn: cc.conn}
		return resp, nil
	}
	if resp.Body == http.NoBody {
		b.finish(true)
		return resp, nil
	}
	resp.Body = b
	return resp, nil
}

// h1Write is the state of one request's write, shared with its reader.
type h1Write struct {
	done    chan struct{} // closed when the write ends; err and wrote are set then
	goOn    chan bool     // Expect: true sends the body, false skips it
	decided sync.Once
	err     error
	wrote   bool // some bytes reached the connection

	// headWait (0: none) bounds the wait for the response head of a
	// request with a body, from the end of its write; mu orders the
	// writer's start of that wait with the reader's end of it, so that a
	// head read before the body is all out leaves no deadline behind.
	headWait time.Duration
	mu       sync.Mutex
	headIn   bool
}

// waitForHead starts the wait for the response head: the request is out,
// or its write failed. Nothing when the head is already in.
func (w *h1Write) waitForHead(conn net.Conn) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.headIn {
		conn.SetReadDeadline(time.Now().Add(w.headWait))
	}
}

// headRead ends the wait for the response head, started or not.
func (w *h1Write) headRead(conn net.Conn) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.headIn = true
	conn.SetReadDeadline(time.Time{})
}

// decide tells a writer waiting on Expect whether to send the body; only
// the first decision counts. It reports whether this call made it.
func (w *h1Write) decide(send bool) (first bool) {
	w.decided.Do(func() {
		w.goOn <- send
		first = true
	})
	return first
}

// write sends the head and the body, then closes req's body.
func (cc *H1Conn) write(w *h1Write, head []byte, body *h1Request, trailer http.Header, expect bool) {
	defer close(w.done)
	if body != nil {
		defer body.rc.Close()
	}
	if w.headWait > 0 {
		defer w.waitForHead(cc.conn)
	}
	cc.conn.SetWriteDeadline(time.Now().Add(cc.opts.writeTimeout()))
	cc.bw.Reset(cc.conn)
	if _, err := cc.bw.Write(head); err != nil {
		w.err = err
		return
	}
	if body == nil || expect {
		w.err = cc.bw.Flush()
		w.wrote = w.err == nil
		if w.err != nil || body == nil {
			return
		}
		if !<-w.goOn {
			return
		}
	}
	w.wrote = true
	src := &bodyReader{r: body.rc}
	var err error
	if body.length < 0 {
		err = writeChunked(cc.bw, cc.conn, src, trailer, cc.opts.writeTimeout())
	} else {
		err = writeFixed(cc.bw, cc.conn, src, body.length, cc.opts.writeTimeout())
	}
	if err == nil {
		err = cc.bw.Flush()
	}
	w.err = err
	if src.err != nil || errors.Is(err, errBodyLength) {
		// The client's body broke off or lied about its length: the
		// request on the wire can never be completed, and the origin
		// would wait for the rest of it. Closing the connection ends the
		// exchange, as net/http does.
		abort(cc.conn)
	}
}

// bodyReader remembers the first error, EOF aside, of reading a request
// body.
type bodyReader struct {
	r   io.Reader
	err error
}

func (b *bodyReader) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	if err != nil && err != io.EOF && b.err == nil {
		b.err = err
	}
	return n, err
}

// errBodyLength marks a request body shorter or longer than its
// Content-Length.
var errBodyLength = errors.New("mirror: request body length")

// readResponse reads the final response head, passing 1xx responses by
// (a 100 lets an Expect body go), all the heads together bounded by
// MaxResponseHeaderBytes.
func (cc *H1Conn) readResponse(req *http.Request, w *h1Write, expect bool) (*http.Response, error) {
	if expect {
		// The body goes after 100 Continue or after the timeout, whichever
		// comes first; a final response first means no body at all.
		t := time.AfterFunc(cc.opts.expectTimeout(), func() { w.decide(true) })
		defer t.Stop()
	}
	// One budget for the final head and the 1xx ones before it, as
	// net/http has it: an origin sending 1xx responses without end fails
	// the request instead of holding it (and the connection) forever. A
	// count would also stop a long WebDAV operation's periodic 102s.
	cc.lr.n = cc.opts.maxHeaderBytes()
	defer func() { cc.lr.n = -1 }()
	for first := true; ; first = false {
		before := cc.lr.n
		buffered := cc.br.Buffered()
		resp, err := http.ReadResponse(cc.br, req)
		limitHit := cc.lr.n == 0
		silent := first && buffered == 0 && cc.lr.n == before
		if err != nil {
			if limitHit {
				return nil, fmt.Errorf("mirror: response headers (1xx ones included) over %d bytes", cc.opts.maxHeaderBytes())
			}
			if silent && (errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)) {
				return nil, fmt.Errorf("mirror: read response: %w: %w", ErrNoResponse, err)
			}
			return nil, fmt.Errorf("mirror: read response: %w", err)
		}
		if resp.StatusCode == http.StatusContinue {
			if expect {
				w.decide(true)
			}
			continue
		}
		if resp.StatusCode >= 100 && resp.StatusCode < 200 && resp.StatusCode != http.StatusSwitchingProtocols {
			continue // 102, 103 Early Hints: informational only
		}
		if expect && w.decide(false) {
			// The body was never asked for, and the origin may still wait
			// for it: the connection is not reused.
			resp.Close = true
		}
		return resp, nil
	}
}

// h1Body is a response body; the connection is idle again at its EOF.
type h1Body struct {
	cc    *H1Conn
	rc    io.ReadCloser
	w     *h1Write
	stop  func() bool
	reuse bool
	once  sync.Once
}

func (b *h1Body) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	if err == io.EOF {
		b.finish(true)
	} else if err != nil {
		b.finish(false)
	}
	return n, err
}

func (b *h1Body) Close() error {
	b.finish(false) // a no-op after EOF
	return b.rc.Close()
}

// finish ends the request: at EOF of a complete exchange the connection
// takes the next request, else it is closed.
func (b *h1Body) finish(eof bool) {
	b.once.Do(func() {
		if !b.stop() {
			// The request's context ended: cc.fail is on its way, on a
			// goroutine of its own. Reused meanwhile, the connection
			// would be closed under the next request.
			eof = false
		}
		if eof {
			// The writer may still be finishing (the answer can beat its
			// last bookkeeping). One still writing after a moment means
			// the origin answered without reading the whole body: the
			// connection's state is unknown, so it is not reused.
			select {
			case <-b.w.done:
			default:
				t := time.NewTimer(50 * time.Millisecond)
				select {
				case <-b.w.done:
				case <-t.C:
					eof = false
				}
				t.Stop()
			}
		}
		// Bytes already read past the response's end mean the origin's
		// framing and ours disagree (a 204 or a HEAD answer with a body,
		// data past Content-Length): the next request would take them for
		// its answer. net/http drops such a connection too.
		if !eof || !b.reuse || b.w.err != nil || b.cc.br.Buffered() > 0 {
			b.cc.fail()
			return
		}
		b.cc.conn.SetDeadline(time.Time{})
		b.cc.mu.Lock()
		b.cc.busy = false
		b.cc.used = true
		b.cc.mu.Unlock()
	})
}

// switched is the body of a 101 response: the connection itself.
type switched struct {
	br   *bufio.Reader
	conn net.Conn
}

func (s *switched) Read(p []byte) (int, error)  { return s.br.Read(p) }
func (s *switched) Write(p []byte) (int, error) { return s.conn.Write(p) }
func (s *switched) Close() error                { return s.conn.Close() }

// h1Request is how a request body goes on the wire.
type h1Request struct {
	rc     io.ReadCloser
	length int64 // -1: unknown, sent chunked
}

// head builds the request head. It returns the body to send (nil when
// none).
func (cc *H1Conn) head(req *http.Request) (*h1Request, []byte, error) {
	if req.URL == nil {
		return nil, nil, errors.New("mirror: request without URL")
	}
	method := req.Method
	if method == "" {
		method = http.MethodGet
	}
	if !httpguts.ValidHeaderFieldName(method) {
		return nil, nil, fmt.Errorf("mirror: invalid method %q", method)
	}
	target := req.URL.RequestURI()
	if method == http.MethodConnect {
		target = req.URL.Host
	}
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}

	var body *h1Request
	framingKey, framingVal := "", ""
	rc, length, err := requestBody(req)
	if err != nil {
		return nil, nil, err
	}
	if rc != nil {
		body = &h1Request{rc: rc, length: length}
		if length < 0 {
			framingKey, framingVal = "Transfer-Encoding", "chunked"
		} else {
			framingKey, framingVal = "Content-Length", strconv.FormatInt(length, 10)
		}
	}
	shape := fingerprint.ShapeFrom(req.Context())
	if body == nil && bodilessLength(method, shape) {
		framingKey, framingVal = "Content-Length", "0"
	}

	h := make(http.Header, len(req.Header)+2)
	for k, vs := range req.Header {
		switch http.CanonicalHeaderKey(k) {
		case "Host", "Content-Length", "Transfer-Encoding":
			continue
		}
		h[k] = vs
	}
	h["Host"] = []string{host}
	if framingKey != "" {
		h[framingKey] = []string{framingVal}
	}
	order := []string{"Host"}
	keepCase := false
	if shape != nil {
		keepCase = shape.PseudoOrder == nil // names from an HTTP/2 client are lowercase
		order = shape.HeaderOrder
		if !hasName(order, "Host") {
			order = append([]string{"Host"}, order...)
		}
		if framingKey != "" && !hasName(order, framingKey) {
			// The client had the other framing header, or none: put this
			// one where the client had its framing.
			other := "Content-Length"
			if framingKey == other {
				other = "Transfer-Encoding"
			}
			if i := indexName(order, other); i >= 0 {
				order = append(order[:i:i], append([]string{framingKey}, order[i+1:]...)...)
			}
		}
	}
	fields := orderFields(h, order, keepCase)
	// Sized up front: one allocation for the head, not one per doubling.
	size := len(method) + len(target) + len(" HTTP/1.1\r\n\r\n")
	for _, f := range fields {
		size += len(f.name) + len(f.value) + len(": \r\n")
	}
	b := make([]byte, 0, size)
	b = append(b, method...)
	b = append(b, ' ')
	b = append(b, target...)
	if http10(req) {
		b = append(b, " HTTP/1.0\r\n"...) // the client's version
	} else {
		b = append(b, " HTTP/1.1\r\n"...)
	}
	for _, f := range fields {
		if !httpguts.ValidHeaderFieldName(f.name) || !validFieldValue(f.value) {
			return nil, nil, fmt.Errorf("mirror: invalid header field %q", f.name)
		}
		b = append(b, f.name...)
		b = append(b, ": "...)
		b = append(b, f.value...)
		b = append(b, "\r\n"...)
	}
	return body, append(b, "\r\n"...), nil
}

func hasName(order []string, name string) bool { return indexName(order, name) >= 0 }

// bodilessLength reports whether a request without a body goes out with
// "Content-Length: 0": as the client sent it (a chunked empty body of an
// HTTP/1.1 client becomes one, in its place), or, without the client's
// shape, for the methods net/http gives one (POST, PUT, PATCH). A client
// that sent no framing field (curl -X POST) gets none.
func bodilessLength(method string, shape *fingerprint.Shape) bool {
	if shape != nil {
		return hasName(shape.HeaderOrder, "Content-Length") || hasName(shape.HeaderOrder, "Transfer-Encoding")
	}
	return method == http.MethodPost || method == http.MethodPut || method == http.MethodPatch
}

// http10 reports whether req came from an HTTP/1.0 client: it goes out as
// HTTP/1.0, and its connection ends with it unless it asked for
// keep-alive.
func http10(req *http.Request) bool { return req.ProtoMajor == 1 && req.ProtoMinor == 0 }

func indexName(order []string, name string) int {
	for i, n := range order {
		if strings.EqualFold(n, name) {
			return i
		}
	}
	return -1
}

// deadlineWriter renews the write deadline before each write, so that a
// long body is bounded per write, not as a whole.
type deadlineWriter struct {
	w       io.Writer
	conn    net.Conn
	timeout time.Duration
}

func (d deadlineWriter) Write(p []byte) (int, error) {
	d.conn.SetWriteDeadline(time.Now().Add(d.timeout))
	return d.w.Write(p)
}

func writeFixed(bw *bufio.Writer, conn net.Conn, body io.Reader, n int64, timeout time.Duration) error {
	dw := deadlineWriter{bw, conn, timeout}
	got, err := io.CopyN(dw, body, n)
	if err != nil {
		if err == io.EOF {
			return fmt.Errorf("%w: %d bytes, Content-Length %d", errBodyLength, got, n)
		}
		return err
	}
	var one [1]byte
	if k, _ := body.Read(one[:]); k > 0 {
		return fmt.Errorf("%w: longer than its Content-Length %d", errBodyLength, n)
	}
	return nil
}

func writeChunked(bw *bufio.Writer, conn net.Conn, body io.Reader, trailer http.Header, timeout time.Duration) error {
	buf := make([]byte, 32<<10)
	for {
		n, err := body.Read(buf)
		if n > 0 {
			conn.SetWriteDeadline(time.Now().Add(timeout))
			fmt.Fprintf(bw, "%x\r\n", n)
			bw.Write(buf[:n])
			if _, werr := bw.WriteString("\r\n"); werr != nil {
				return werr
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
	}
	conn.SetWriteDeadline(time.Now().Add(timeout))
	bw.WriteString("0\r\n")
	for k, vs := range trailer {
		for _, v := range vs {
			if !httpguts.ValidHeaderFieldName(k) || !validFieldValue(v) {
				return fmt.Errorf("mirror: invalid trailer field %q", k)
			}
			fmt.Fprintf(bw, "%s: %s\r\n", k, v)
		}
	}
	_, err := bw.WriteString("\r\n")
	return err
}

// limitReader fails reads past n bytes; n < 0 means no limit. It bounds
// what http.ReadResponse may buffer for one header section.
type limitReader struct {
	r io.Reader
	n int64
}

var errHeaderTooLarge = errors.New("mirror: response header too large")

func (l *limitReader) Read(p []byte) (int, error) {
	if l.n == 0 {
		return 0, errHeaderTooLarge
	}
	if l.n > 0 && int64(len(p)) > l.n {
		p = p[:l.n]
	}
	n, err := l.r.Read(p)
	if l.n > 0 {
		l.n -= int64(n)
	}
	return n, err
}
