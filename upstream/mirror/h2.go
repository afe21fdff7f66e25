package mirror

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http/httpguts"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/httpstatus"
)

// defaultPreface is sent when no client preface is given: Go's own
// client's ("2:0;4:4194304;5:16384;6:10485760|1073741824|0|a,m,p,s"), which
// is what the proxy sent for every client before it mirrored them.
var defaultPreface = fingerprint.H2{
	Settings:      []fingerprint.Setting{{ID: 2, Val: 0}, {ID: 4, Val: 4 << 20}, {ID: 5, Val: 16384}, {ID: 6, Val: 10 << 20}},
	WindowUpdate:  1 << 30,
	PseudoOrder:   []string{":authority", ":method", ":path", ":scheme"},
	FirstStreamID: 1,
}

// HTTP/2 protocol constants (RFC 9113).
const (
	initialWindow      = 65535
	maxWindow          = 1<<31 - 1
	defaultMaxFrame    = 16384
	defaultTableSize   = 4096
	maxStreamID        = 1<<31 - 1
	assumedMaxStreams  = 100 // until the peer's SETTINGS say otherwise
	defaultHeaderLimit = 10 << 20
	// maxInterim bounds the 1xx responses before a final one, as net/http
	// does: an origin sending them without end would hold the request
	// (and its stream) forever.
	maxInterim = 5
)

// An H2Conn is an HTTP/2 client connection that presents the client's
// preface: its SETTINGS in order, connection WINDOW_UPDATE, PRIORITY
// frames and first stream id, then each request's pseudo-header order,
// header order and HEADERS priority. The windows it grants the origin are
// exactly the ones those settings announce; credit is returned as the
// response bodies are read.
type H2Conn struct {
	conn net.Conn
	opts Options
	pre  *fingerprint.H2

	wmu sync.Mutex // serializes writes; guards bw, fr's writing side, henc, hbuf
	// queued counts the writers waiting for wmu (see lockWrite, flush).
	queued atomic.Int32
	bw     *bufio.Writer
	fr     *http2.Framer
	henc   *hpack.Encoder
	hbuf   bytes.Buffer

	// Lock order: wmu before mu.
	mu      sync.Mutex
	cond    *sync.Cond // on mu: send windows grew, a stream ended, the connection closed
	streams map[uint32]*h2Stream
	nextID  uint32
	closed  bool  // no more streams: Close, GOAWAY or a dead connection
	err     error // why the read loop ended

	seenSettings     bool // the peer's first SETTINGS arrived
	peerMaxStreams   uint32
	peerInitWindow   int64
	peerMaxFrame     uint32
	peerMaxHeaderLst uint64 // 0: no limit
	sendWindow       int64  // connection-level credit the peer gave
	recvWindow       int64  // connection-level credit the peer has left
	recvUnacked      int64  // consumed bytes not yet returned to the peer
	ourStreamWindow  int64  // the INITIAL_WINDOW_SIZE we announced
	ourConnWindow    int64  // the connection window we announced

	readDone chan struct{}

	// Liveness (see Options.PingTimeout): when the read loop last read a
	// frame, as time since born (monotonic), and whether a PING is out.
	born     time.Time
	lastRead atomic.Int64
	pinging  atomic.Bool
	pings    uint64 // PINGs sent, the payload of the next; wmu
}

// NewH2Conn sends the preface on c, an established connection to the
// origin that negotiated h2, and starts reading. pre is the client's
// preface (nil: x/net's defaults).
func NewH2Conn(c net.Conn, pre *fingerprint.H2, opts Options) (*H2Conn, error) {
	if pre == nil {
		pre = &defaultPreface
	}
	cc := &H2Conn{
		conn:           c,
		opts:           opts,
		pre:            pre,
		streams:        make(map[uint32]*h2Stream),
		nextID:         1,
		peerMaxStreams: assumedMaxStreams,
		peerInitWindow: initialWindow,
		peerMaxFrame:   defaultMaxFrame,
		sendWindow:     initialWindow,
		recvWindow:     initialWindow,
		readDone:       make(chan struct{}),
		born:           time.Now(),
	}
	cc.cond = sync.NewCond(&cc.mu)
	cc.bw = bufio.NewWriterSize(socketWriter{cc}, 32<<10)
	if pre.FirstStreamID%2 == 1 {
		cc.nextID = pre.FirstStreamID
	}
	tableSize := uint32(defaultTableSize)
	headerLimit := uint32(defaultHeaderLimit)
	maxFrame := uint32(defaultMaxFrame)
	cc.ourStreamWindow = initialWindow
	for _, s := range pre.Settings {
		switch http2.SettingID(s.ID) {
		case http2.SettingHeaderTableSize:
			tableSize = min(s.Val, 1<<20) // the decoder's table, bounded
		case http2.SettingInitialWindowSize:
			cc.ourStreamWindow = int64(min(s.Val, maxWindow))
		case http2.SettingMaxFrameSize:
			maxFrame = min(max(s.Val, defaultMaxFrame), 1<<24-1)
		case http2.SettingMaxHeaderListSize:
			headerLimit = s.Val
		}
	}
	cc.ourConnWindow = initialWindow + int64(pre.WindowUpdate)
	cc.recvWindow = cc.ourConnWindow
	cc.fr = http2.NewFramer(cc.bw, c)
	cc.fr.ReadMetaHeaders = hpack.NewDecoder(tableSize, nil)
	// The client's own limit goes out in its SETTINGS as it sent it (the
	// fingerprint); what the proxy reads is bounded by its own as well,
	// as on HTTP/1.1.
	cc.fr.MaxHeaderListSize = uint32(min(int64(headerLimit), cc.opts.maxHeaderBytes()))
	cc.fr.SetMaxReadFrameSize(maxFrame)
	cc.henc = hpack.NewEncoder(&cc.hbuf)

	if err := cc.writePreface(); err != nil {
		c.Close()
		return nil, fmt.Errorf("mirror: h2 preface: %w", err)
	}
	go cc.readLoop()
	return cc, nil
}

func (cc *H2Conn) writePreface() error {
	cc.lockWrite()
	defer cc.wmu.Unlock()
	cc.bw.WriteString(http2.ClientPreface)
	settings := make([]http2.Setting, len(cc.pre.Settings))
	for i, s := range cc.pre.Settings {
		settings[i] = http2.Setting{ID: http2.SettingID(s.ID), Val: s.Val}
	}
	if err := cc.fr.WriteSettings(settings...); err != nil {
		return err
	}
	if cc.pre.WindowUpdate > 0 {
		if err := cc.fr.WriteWindowUpdate(0, cc.pre.WindowUpdate); err != nil {
			return err
		}
	}
	for _, p := range cc.pre.Priorities {
		if err := cc.fr.WritePriority(p.StreamID, http2.PriorityParam{StreamDep: p.StreamDep, Exclusive: p.Exclusive, Weight: p.Weight}); err != nil {
			return err
		}
	}
	return cc.flush()
}

// lockWrite takes wmu, counted while it waits.
func (cc *H2Conn) lockWrite() {
	cc.queued.Add(1)
	cc.wmu.Lock()
	cc.queued.Add(-1)
}

// flush writes the buffered frames unless another writer waits for wmu:
// its frames then join these and its flush sends them all, in one write
// where concurrent requests would each have cost one. Every writer ends
// with a flush (or a fatal error), so the last one in a row always
// writes. wmu held, taken with lockWrite.
func (cc *H2Conn) flush() error {
	if cc.queued.Load() > 0 {
		return nil
	}
	return cc.bw.Flush()
}

// socketWriter is the socket under bw. It sets the write deadline before
// each write because bw writes not only in flush: a frame that does not
// fit the buffer's room makes bw write at once, in the middle of building
// a header block. A deadline set only by flush would by then be the last
// flush's, long past on a connection that idled, and the write would fail
// with a timeout that kills the connection. Setting it here costs what
// setting it in flush did, once per write to the socket. A connection
// without deadlines is written to unbounded, as before.
type socketWriter struct{ cc *H2Conn }

func (w socketWriter) Write(p []byte) (int, error) {
	err := w.cc.conn.SetWriteDeadline(time.Now().Add(w.cc.opts.writeTimeout()))
	if err != nil && !errors.Is(err, os.ErrNoDeadline) {
		return 0, fmt.Errorf("mirror: h2 set write deadline: %w", err)
	}
	return w.cc.conn.Write(p)
}

// CanTakeRequest reports whether a new stream can be opened now.
func (cc *H2Conn) CanTakeRequest() bool {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	return !cc.closed && uint32(len(cc.streams)) < cc.peerMaxStreams && cc.nextID <= maxStreamID
}

// Close closes the connection; requests in flight fail.
func (cc *H2Conn) Close() error {
	cc.mu.Lock()
	cc.closed = true
	cc.mu.Unlock()
	err := cc.conn.Close()
	<-cc.readDone
	return err
}

// h2Stream is one request on the connection. Fields below mu are guarded
// by cc.mu.
type h2Stream struct {
	cc   *H2Conn
	id   uint32
	req  *http.Request
	body io.ReadCloser // the request body being sent; nil when none
	sent func()        // called once the request is all out; nil: nothing (RoundTripSent)

	respReady  chan struct{} // closed when resp is set
	done       chan struct{} // closed when the stream is over
	continueCh chan struct{} // closed on 100 Continue
	stopCtx    func() bool

	// mu
	resp        *http.Response
	wantLen     int64 // the response's Content-Length, -1 if none
	gotLen      int64
	noBody      bool // the response has no content (HEAD, 204, 304): DATA on it is malformed
	sendWindow  int64
	recvWindow  int64
	recvUnacked int64
	buf         [][]byte
	bufLen      int64
	recvEnded   bool        // END_STREAM received
	trailer     http.Header // trailers received, moved to resp.Trailer at the body's EOF
	sendEnded   bool        // END_STREAM sent
	// sendStopped: the request body will never be sent, as the origin
	// answered an Expect: 100-continue request without asking for it.
	// END_STREAM will not go out, so the stream is reset once the
	// response has been read (see cancelUnsent).
	sendStopped bool
	sawEOF      bool // the reader reached the end of the response body
	over        bool // done is closed, the stream is out of the map
	err         error
	readCond    *sync.Cond
	continued   bool
	interim     int // 1xx responses received
}

// RoundTrip sends req on a new stream and waits for the response head.
// The header fields go out in the order of the request context's
// [fingerprint.Shape], the pseudo-headers in its order (else the
// connection preface's), with its HEADERS priority.
func (cc *H2Conn) RoundTrip(req *http.Request) (*http.Response, error) {
	return cc.RoundTripSent(req, nil)
}

// RoundTripSent is RoundTrip, calling sent (nil: nothing) once the request
// is all out: its END_STREAM written, on the HEADERS or after the body.
// A caller's wait for the response head starts there, as net/http's
// ResponseHeaderTimeout does: an upload may take longer than that wait.
func (cc *H2Conn) RoundTripSent(req *http.Request, sent func()) (*http.Response, error) {
	body, length, err := requestBody(req)
	if err != nil {
		return nil, err
	}
	closeBody := func() {
		if body != nil {
			body.Close()
		}
	}
	shape := fingerprint.ShapeFrom(req.Context())
	fields, err := cc.requestFields(req, shape, body != nil, length)
	if err != nil {
		closeBody()
		return nil, err
	}
	var prio *fingerprint.Priority
	if shape != nil {
		prio = shape.Priority
	} else {
		prio = cc.pre.HeaderPriority
	}
	ctx := req.Context()
	if err := ctx.Err(); err != nil {
		closeBody()
		return nil, err
	}
	cs := &h2Stream{
		cc: cc, req: req, body: body, sent: sent,
		respReady:  make(chan struct{}),
		done:       make(chan struct{}),
		continueCh: make(chan struct{}),
		wantLen:    -1,
	}
	cs.readCond = sync.NewCond(&cc.mu)

	// Take a stream slot. Stream ids must go out in increasing order, so
	// the id is assigned and the HEADERS written under wmu.
	wake := context.AfterFunc(ctx, func() {
		cc.mu.Lock()
		cc.cond.Broadcast()
		cc.mu.Unlock()
	})
	for {
		cc.lockWrite()
		cc.mu.Lock()
		if cc.closed || cc.nextID > maxStreamID {
			cc.mu.Unlock()
			// Frames another writer left for us to flush (see flush).
			_ = cc.flush()
			cc.wmu.Unlock()
			wake()
			closeBody()
			return nil, fmt.Errorf("mirror: h2 connection closed: %w", ErrUnprocessed)
		}
		// One stream may open before the origin's SETTINGS (browsers send
		// their first request at once); more wait to learn its limit
		// rather than be refused.
		if uint32(len(cc.streams)) < cc.peerMaxStreams && (cc.seenSettings || len(cc.streams) == 0) {
			break
		}
		// Frames another writer left for us to flush must not wait with us.
		_ = cc.flush()
		cc.wmu.Unlock()
		if err := ctx.Err(); err != nil {
			cc.mu.Unlock()
			wake()
			closeBody()
			return nil, err
		}
		cc.cond.Wait()
		cc.mu.Unlock()
	}
	wake()
	cs.id = cc.nextID
	cc.nextID += 2
	prio = cc.streamPriority(prio, cs.id)
	cs.sendWindow = cc.peerInitWindow
	cs.recvWindow = cc.ourStreamWindow
	cs.sendEnded = body == nil // END_STREAM rides on the HEADERS
	cc.streams[cs.id] = cs
	maxFrame, headerLimit := cc.peerMaxFrame, cc.peerMaxHeaderLst
	cc.mu.Unlock()
	pingSent, err := cc.maybePing()
	if err == nil {
		err = cc.writeHeaders(cs.id, fields, prio, body == nil, maxFrame, headerLimit)
	}
	if errors.Is(err, errHeaderListSize) {
		// Nothing of ours went out, but frames another writer left for
		// us to flush did not either.
		_ = cc.flush()
	}
	cc.wmu.Unlock()
	if pingSent > 0 {
		// Whatever became of the HEADERS, the PING went out (a refused
		// header list still flushed it) or the connection is done.
		cc.awaitPing(pingSent)
	}
	if err != nil {
		cs.abort(err, 0)
		closeBody()
		if errors.Is(err, errHeaderListSize) {
			return nil, err
		}
		cc.fatal(err)
		return nil, fmt.Errorf("mirror: h2 write headers: %w", err)
	}
	if body != nil {
		expect := strings.EqualFold(req.Header.Get("Expect"), "100-continue")
		go cs.writeBody(length, req.Trailer, expect)
	} else if sent != nil {
		sent()
	}
	stop := context.AfterFunc(ctx, func() { cs.abort(ctx.Err(), http2.ErrCodeCancel) })
	cc.mu.Lock()
	if cs.over {
		stop()
	} else {
		cs.stopCtx = stop
	}
	cc.mu.Unlock()

	select {
	case <-cs.respReady:
		return cs.resp, nil
	case <-cs.done:
		cc.mu.Lock()
		err := cs.err
		resp := cs.resp
		cc.mu.Unlock()
		if resp != nil {
			return resp, nil // a complete response that ended the stream at once
		}
		return nil, err
	}
}

// streamPriority is the HEADERS priority of stream id for the client's
// priority p. The client's dependency names a stream of its own connection
// to the proxy, numbered apart from the streams here (a browser chains each
// request to the one before it, exclusively). Kept as it was, it may name
// stream id itself, which an origin answers with PROTOCOL_ERROR. So a
// dependency on one of the preface's PRIORITY streams (which exist here
// too: the preface sent them) stays, and any other becomes the stream
// opened before this one on this connection: the client's tree, in this
// connection's numbers.
func (cc *H2Conn) streamPriority(p *fingerprint.Priority, id uint32) *fingerprint.Priority {
	if p == nil || p.StreamDep == 0 {
		return p
	}
	for _, q := range cc.pre.Priorities {
		if q.StreamID == p.StreamDep {
			return p
		}
	}
	first := uint32(1)
	if cc.pre.FirstStreamID%2 == 1 {
		first = cc.pre.FirstStreamID
	}
	out := *p
	out.StreamDep = 0
	if id >= first+2 {
		out.StreamDep = id - 2
	}
	return &out
}

var errHeaderListSize = errors.New("mirror: request header list larger than the origin's SETTINGS_MAX_HEADER_LIST_SIZE")

// writeHeaders encodes the fields and writes HEADERS (and CONTINUATION)
// frames. HEADERS is framed here, not by the Framer, because the Framer
// leaves out a priority block that is all zeros (weight 1, no
// dependency), and the client's must go out as it was. wmu held.
func (cc *H2Conn) writeHeaders(id uint32, fields []hpack.HeaderField, prio *fingerprint.Priority, endStream bool, maxFrame uint32, limit uint64) error {
	var size uint64
	for _, f := range fields {
		size += uint64(f.Size())
	}
	if limit > 0 && size > limit {
		return errHeaderListSize
	}
	cc.hbuf.Reset()
	for _, f := range fields {
		if err := cc.henc.WriteField(f); err != nil {
			return err
		}
	}
	block := cc.hbuf.Bytes()
	var flags http2.Flags
	if endStream {
		flags |= http2.FlagHeadersEndStream
	}
	var payload []byte
	if prio != nil {
		flags |= http2.FlagHeadersPriority
		dep := prio.StreamDep
		if prio.Exclusive {
			dep |= 1 << 31
		}
		payload = binary.BigEndian.AppendUint32(payload, dep)
		payload = append(payload, prio.Weight)
	}
	first := min(len(block), int(maxFrame)-len(payload))
	payload = append(payload, block[:first]...)
	rest := block[first:]
	if len(rest) == 0 {
		flags |= http2.FlagHeadersEndHeaders
	}
	if err := cc.fr.WriteRawFrame(http2.FrameHeaders, flags, id, payload); err != nil {
		return err
	}
	for len(rest) > 0 {
		k := min(len(rest), int(maxFrame))
		if err := cc.fr.WriteContinuation(id, k == len(rest), rest[:k]); err != nil {
			return err
		}
		rest = rest[k:]
	}
	return cc.flush()
}

// requestBody returns the body to send and its length (-1: unknown),
// telling net/http's "ContentLength 0 with a Body" (unknown) apart from an
// empty body by reading one byte.
func requestBody(req *http.Request) (io.ReadCloser, int64, error) {
	if req.Body == nil || req.Body == http.NoBody {
		return nil, 0, nil
	}
	if req.ContentLength != 0 {
		return req.Body, req.ContentLength, nil
	}
	var one [1]byte
	n, err := io.ReadFull(req.Body, one[:])
	if n == 0 {
		req.Body.Close()
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return nil, 0, nil
		}
		return nil, 0, fmt.Errorf("mirror: read request body: %w", err)
	}
	return struct {
		io.Reader
		io.Closer
	}{io.MultiReader(bytes.NewReader(one[:]), req.Body), req.Body}, -1, nil
}

// requestFields builds the header block: pseudo-headers in the shape's
// order (else the preface's), then the fields in the shape's order, minus
// what HTTP/2 forbids. Nothing is added that the client did not send but
// content-length where it belongs.
func (cc *H2Conn) requestFields(req *http.Request, shape *fingerprint.Shape, hasBody bool, length int64) ([]hpack.HeaderField, error) {
	if req.URL == nil {
		return nil, errors.New("mirror: request without URL")
	}
	method := req.Method
	if method == "" {
		method = http.MethodGet
	}
	if !httpguts.ValidHeaderFieldName(method) {
		return nil, fmt.Errorf("mirror: invalid method %q", method)
	}
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}
	scheme := req.URL.Scheme
	if scheme == "" {
		scheme = "https"
	}
	value := func(p string) string {
		switch p {
		case ":method":
			return method
		case ":authority":
			return host
		case ":scheme":
			return scheme
		}
		return req.URL.RequestURI()
	}
	want := []string{":method", ":authority", ":scheme", ":path"}
	if method == http.MethodConnect {
		want = want[:2]
	}
	pseudo := cc.pre.PseudoOrder
	if shape != nil && len(shape.PseudoOrder) > 0 {
		pseudo = shape.PseudoOrder
	}
	fields := make([]hpack.HeaderField, 0, len(want)+len(req.Header)+1)
	// The client's order first, then any it did not name, each once.
	add := func(p string) {
		if slices.Contains(want, p) && !slices.ContainsFunc(fields, func(f hpack.HeaderField) bool { return f.Name == p }) {
			fields = append(fields, hpack.HeaderField{Name: p, Value: value(p)})
		}
	}
	for _, p := range pseudo {
		add(p)
	}
	for _, p := range want {
		add(p)
	}

	h := make(http.Header, len(req.Header)+1)
	for k, vs := range req.Header {
		c := http.CanonicalHeaderKey(k)
		switch {
		case slices.Contains(hopHeaders, c), c == "Host", c == "Content-Length":
			continue
		case c == "Te":
			// Only "trailers" may go in an HTTP/2 TE field.
			if len(vs) != 1 || !strings.EqualFold(vs[0], "trailers") {
				continue
			}
		}
		if prev, ok := h[c]; ok {
			h[c] = append(prev[:len(prev):len(prev)], vs...)
		} else {
			h[c] = vs // shared, not copied: only replaced below, never written into
		}
	}
	var order []string
	if shape != nil {
		order = shape.HeaderOrder
	}
	if (hasBody && length >= 0) || (!hasBody && bodilessLength(method, shape)) {
		h["Content-Length"] = []string{strconv.FormatInt(length, 10)}
	}
	// HTTP/2 clients send each cookie crumb as a field of its own; a
	// server joins them with "; ". Split them back when the client sent
	// several.
	if n := countName(order, "cookie"); n > 1 && len(h["Cookie"]) == 1 {
		h["Cookie"] = strings.Split(h["Cookie"][0], "; ")
	}
	// The names in the client's order as it spelled them: an HTTP/2
	// client's are lower-case already, and ToLower then copies nothing.
	for _, f := range orderFields(h, order, true) {
		name := strings.ToLower(f.name)
		if !httpguts.ValidHeaderFieldName(name) || !validFieldValue(f.value) {
			return nil, fmt.Errorf("mirror: invalid header field %q", f.name)
		}
		fields = append(fields, hpack.HeaderField{Name: name, Value: f.value})
	}
	return fields, nil
}

func countName(order []string, name string) int {
	n := 0
	for _, o := range order {
		if strings.EqualFold(o, name) {
			n++
		}
	}
	return n
}

// writeBody sends the request body as DATA frames within the send
// windows, then END_STREAM (or the trailers). It owns and closes the body.
func (cs *h2Stream) writeBody(length int64, trailer http.Header, expect bool) {
	cc := cs.cc
	defer cs.body.Close()
	if expect {
		t := time.NewTimer(cc.opts.expectTimeout())
		select {
		case <-cs.continueCh:
		case <-t.C:
		case <-cs.respReady:
			// A final answer first: the body is not wanted, but the
			// response is, and resetting the stream now would cut it
			// off. Stop sending and leave the stream to the reader.
			t.Stop()
			cs.stopSending()
			return
		case <-cs.done:
			t.Stop()
			return
		}
		t.Stop()
	}
	buf := make([]byte, defaultMaxFrame)
	var sent int64
	for {
		n, rerr := cs.body.Read(buf)
		data := buf[:n]
		for len(data) > 0 {
			cc.mu.Lock()
			// Not cc.closed: after a GOAWAY that names this stream the
			// origin still reads its body. A connection that dies ends
			// its streams (readLoop), which is what cs.over says.
			for !cs.over && (cs.sendWindow <= 0 || cc.sendWindow <= 0) {
				cc.cond.Wait()
			}
			if cs.over {
				cc.mu.Unlock()
				return
			}
			k := min(int64(len(data)), cs.sendWindow, cc.sendWindow, int64(cc.peerMaxFrame))
			cs.sendWindow -= k
			cc.sendWindow -= k
			cc.mu.Unlock()
			sent += k
			end := length >= 0 && sent == length && len(trailer) == 0
			if length >= 0 && sent > length {
				cs.abort(fmt.Errorf("mirror: request body longer than its Content-Length %d", length), http2.ErrCodeCancel)
				return
			}
			cc.lockWrite()
			err := cc.fr.WriteData(cs.id, end, data[:k])
			if err == nil {
				err = cc.flush()
			}
			cc.wmu.Unlock()
			if err != nil {
				cc.fatal(err)
				return
			}
			data = data[k:]
			if end {
				cs.sentEnd()
				return
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			cs.abort(fmt.Errorf("mirror: read request body: %w", rerr), http2.ErrCodeCancel)
			return
		}
	}
	if length >= 0 && sent != length {
		cs.abort(fmt.Errorf("mirror: request body of %d bytes, Content-Length %d", sent, length), http2.ErrCodeCancel)
		return
	}
	cc.lockWrite()
	var err error
	if len(trailer) > 0 {
		var fields []hpack.HeaderField
		for _, f := range orderFields(trailer, nil, false) {
			fields = append(fields, hpack.HeaderField{Name: strings.ToLower(f.name), Value: f.value})
		}
		cc.mu.Lock()
		maxFrame := cc.peerMaxFrame
		cc.mu.Unlock()
		err = cc.writeHeaders(cs.id, fields, nil, true, maxFrame, 0)
	} else {
		err = cc.fr.WriteData(cs.id, true, nil)
		if err == nil {
			err = cc.flush()
		}
	}
	cc.wmu.Unlock()
	if err != nil {
		cc.fatal(err)
		return
	}
	cs.sentEnd()
}

// stopSending gives up the request body for good, the stream staying open
// for the response.
func (cs *h2Stream) stopSending() {
	cc := cs.cc
	cc.mu.Lock()
	cs.sendStopped = true
	rst := cs.cancelUnsent()
	cc.mu.Unlock()
	if rst {
		if err := cc.writeControl(cs.id, http2.ErrCodeCancel, 0, 0); err != nil {
			cc.fatal(err)
		}
	}
}

// cancelUnsent ends a stream whose request body was given up and whose
// response the reader has read to its end. END_STREAM never went out, so
// the origin holds its side open until it is reset: it reports whether
// RST_STREAM (CANCEL) is due. Whichever of the reader and the body writer
// comes last does it. mu held.
func (cs *h2Stream) cancelUnsent() bool {
	if cs.over || !cs.sendStopped || cs.sendEnded || !cs.sawEOF {
		return false
	}
	cs.end(nil)
	return true
}

// sentEnd records END_STREAM sent.
func (cs *h2Stream) sentEnd() {
	cc := cs.cc
	cc.mu.Lock()
	cs.sendEnded = true
	cs.maybeDone()
	cc.mu.Unlock()
	if cs.sent != nil {
		cs.sent()
	}
}

// maybeDone ends a stream both sides have finished. mu held.
func (cs *h2Stream) maybeDone() {
	if cs.recvEnded && cs.sendEnded && cs.bufLen == 0 {
		cs.end(nil)
	}
}

// credit counts n bytes of the stream's window as consumed and returns
// the WINDOW_UPDATE increment due for the stream, 0 until half the window
// is. mu held.
func (cs *h2Stream) credit(n int64) int64 {
	cs.recvUnacked += n
	if cs.recvUnacked < cs.cc.ourStreamWindow/2 {
		return 0
	}
	inc := cs.recvUnacked
	cs.recvUnacked = 0
	cs.recvWindow += inc
	return inc
}

// end takes the stream out of the connection. mu held.
func (cs *h2Stream) end(err error) {
	if cs.over {
		return
	}
	cs.over = true
	if cs.err == nil {
		cs.err = err
	}
	delete(cs.cc.streams, cs.id)
	close(cs.done)
	if cs.stopCtx != nil {
		cs.stopCtx()
	}
	cs.readCond.Broadcast()
	cs.cc.cond.Broadcast()
}

// abort ends the stream with err and resets it at the origin with rst
// (CANCEL when the proxy gives up, FLOW_CONTROL_ERROR for the origin's
// own fault; 0: no reset). Buffered response bytes go back to the connection window,
// also those of a stream already over (ended by an error the reader has
// not read up to yet): nobody will read them now.
func (cs *h2Stream) abort(err error, rst http2.ErrCode) {
	cc := cs.cc
	cc.mu.Lock()
	connInc := cs.discard()
	if cs.over {
		cc.mu.Unlock()
		if err := cc.writeControl(cs.id, 0, 0, connInc); err != nil {
			cc.fatal(err)
		}
		return
	}
	ended := cs.recvEnded && cs.sendEnded
	cs.end(err)
	cc.mu.Unlock()
	if cs.body != nil {
		cs.body.Close() // unblocks a writer stuck reading the request body
	}
	if ended {
		rst = 0 // the stream is closed both ways: nothing to reset
	}
	if err := cc.writeControl(cs.id, rst, 0, connInc); err != nil {
		cc.fatal(err)
	}
}

// discard drops the response bytes buffered for the reader and returns
// the connection WINDOW_UPDATE increment due (see consumeConn). The origin
// counted those bytes against the connection window when it sent them;
// unless they are counted as consumed here, the window never gets them
// back, and enough of them stall every stream on the connection. The
// stream's own window needs nothing: the stream is over. mu held.
func (cs *h2Stream) discard() int64 {
	n := cs.bufLen
	cs.buf, cs.bufLen = nil, 0
	return cs.cc.consumeConn(n)
}

// writeControl sends, in this order and with one flush, an RST_STREAM of
// stream id with code rst (none when 0), and the WINDOW_UPDATEs due to the
// stream and to the connection (none when 0). It writes nothing when
// nothing is due.
func (cc *H2Conn) writeControl(id uint32, rst http2.ErrCode, streamInc, connInc int64) error {
	if rst == 0 && streamInc <= 0 && connInc <= 0 {
		return nil
	}
	cc.lockWrite()
	defer cc.wmu.Unlock()
	if rst != 0 {
		if err := cc.fr.WriteRSTStream(id, rst); err != nil {
			return err
		}
	}
	if streamInc > 0 {
		if err := cc.fr.WriteWindowUpdate(id, uint32(streamInc)); err != nil {
			return err
		}
	}
	if connInc > 0 {
		if err := cc.fr.WriteWindowUpdate(0, uint32(connInc)); err != nil {
			return err
		}
	}
	return cc.flush()
}

// consumeConn counts n bytes consumed on the connection and returns the
// WINDOW_UPDATE increment due (0 if none yet): credit goes back once half
// the announced window is used, as browsers do. mu held.
func (cc *H2Conn) consumeConn(n int64) int64 {
	cc.recvUnacked += n
	if cc.recvUnacked == 0 || cc.recvUnacked < cc.ourConnWindow/2 {
		return 0
	}
	inc := cc.recvUnacked
	cc.recvUnacked = 0
	cc.recvWindow += inc
	return inc
}

// fatal closes a connection that cannot go on.
func (cc *H2Conn) fatal(err error) {
	cc.mu.Lock()
	if cc.err == nil {
		cc.err = err
	}
	cc.closed = true
	cc.mu.Unlock()
	abort(cc.conn)
}

// h2Body is a response body.
type h2Body struct{ cs *h2Stream }

func (b h2Body) Read(p []byte) (int, error) {
	cs := b.cs
	cc := cs.cc
	cc.mu.Lock()
	for cs.bufLen == 0 && !cs.recvEnded && cs.err == nil && !cs.over {
		cs.readCond.Wait()
	}
	if cs.bufLen == 0 {
		err := cs.err
		rst := false
		if err == nil && cs.recvEnded {
			err = io.EOF
			if cs.wantLen >= 0 && cs.gotLen != cs.wantLen {
				err = fmt.Errorf("mirror: response body of %d bytes, Content-Length %d", cs.gotLen, cs.wantLen)
			}
			for k, vs := range cs.trailer {
				cs.resp.Trailer[k] = vs
			}
			clear(cs.trailer)
			cs.sawEOF = true
			cs.maybeDone()
			rst = cs.cancelUnsent()
		} else if err == nil {
			err = errors.New("mirror: stream closed")
		}
		id := cs.id
		cc.mu.Unlock()
		if rst {
			if werr := cc.writeControl(id, http2.ErrCodeCancel, 0, 0); werr != nil {
				cc.fatal(werr)
			}
		}
		return 0, err
	}
	n := 0
	for n < len(p) && len(cs.buf) > 0 {
		k := copy(p[n:], cs.buf[0])
		n += k
		if k == len(cs.buf[0]) {
			cs.buf = cs.buf[1:]
		} else {
			cs.buf[0] = cs.buf[0][k:]
		}
	}
	cs.bufLen -= int64(n)
	var streamInc int64
	if !cs.recvEnded {
		streamInc = cs.credit(int64(n))
	}
	connInc := cc.consumeConn(int64(n))
	id := cs.id
	cc.mu.Unlock()
	if err := cc.writeControl(id, 0, streamInc, connInc); err != nil {
		cc.fatal(err)
	}
	return n, nil
}

var errBodyClosed = errors.New("mirror: response body closed")

// Close ends the stream. A response read in full while the request body
// is still being sent (the origin answered early and may never open its
// window again), or was given up (see sendStopped), is ended too: the
// rest of the body is not wanted. Unread bytes go back to the connection
// window, as net/http's transport does, whatever the stream's state.
func (b h2Body) Close() error {
	cs := b.cs
	cc := cs.cc
	cc.mu.Lock()
	complete := cs.recvEnded && cs.sendEnded
	var connInc int64
	if complete {
		connInc = cs.discard()
		cs.maybeDone()
	}
	cc.mu.Unlock()
	if !complete {
		cs.abort(errBodyClosed, http2.ErrCodeCancel)
		return nil
	}
	if err := cc.writeControl(cs.id, 0, 0, connInc); err != nil {
		cc.fatal(err)
	}
	return nil
}

// maybePing writes a PING ahead of a request when the connection has read
// nothing for the ping timeout and no PING is out yet, and returns when
// (as time since born; 0: no PING). wmu held; the caller's flush sends it
// with the request's HEADERS.
func (cc *H2Conn) maybePing() (time.Duration, error) {
	timeout := cc.opts.pingTimeout()
	now := time.Since(cc.born)
	if timeout < 0 || now-time.Duration(cc.lastRead.Load()) < timeout || !cc.pinging.CompareAndSwap(false, true) {
		return 0, nil
	}
	cc.pings++
	var data [8]byte
	binary.BigEndian.PutUint64(data[:], cc.pings)
	// Taken before the PING goes out: its answer may be read before the
	// writer gets on.
	err := cc.fr.WritePing(false, data)
	return now, err
}

// awaitPing closes the connection when nothing at all (the PING's answer
// or any other frame) arrives within the ping timeout of sent: it is
// dead, and the requests on it that have no response yet fail with
// ErrNoResponse (see readLoop).
func (cc *H2Conn) awaitPing(sent time.Duration) {
	timeout := cc.opts.pingTimeout()
	time.AfterFunc(timeout, func() {
		if time.Duration(cc.lastRead.Load()) < sent {
			cc.fatal(fmt.Errorf("mirror: h2 origin answered nothing within %v of a PING", timeout))
		}
		cc.pinging.Store(false)
	})
}

// readLoop reads frames until the connection ends, then fails what is
// left. A stream that had no response yet fails with ErrNoResponse: the
// origin (or a gateway between) dropped the connection before answering
// it, most likely while it idled, and a caller may send it again as it
// would on HTTP/1.1.
func (cc *H2Conn) readLoop() {
	defer close(cc.readDone)
	var push pushBlock
	var err error
	for {
		var f http2.Frame
		f, err = cc.fr.ReadFrame()
		cc.lastRead.Store(int64(time.Since(cc.born)))
		if err != nil {
			var se http2.StreamError
			if errors.As(err, &se) {
				if cs := cc.stream(se.StreamID); cs != nil {
					cs.abort(se, http2.ErrCodeCancel)
				}
				continue
			}
			break
		}
		if err = cc.handle(f, &push); err != nil {
			break
		}
	}
	cc.conn.Close()
	cc.mu.Lock()
	if cc.err == nil {
		cc.err = err
	}
	cc.closed = true
	streamErr := fmt.Errorf("mirror: h2 connection lost: %w", cc.err)
	unanswered := fmt.Errorf("mirror: h2 connection lost: %w: %w", ErrNoResponse, cc.err)
	for _, cs := range cc.streams {
		if cs.resp != nil && cs.recvEnded {
			// Answered in full: what is buffered is the whole body.
			cs.end(nil)
		} else if cs.resp == nil && cs.interim == 0 {
			cs.end(unanswered)
		} else {
			cs.end(streamErr)
		}
	}
	cc.cond.Broadcast()
	cc.mu.Unlock()
}

func (cc *H2Conn) stream(id uint32) *h2Stream {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	return cc.streams[id]
}

// pushBlock gathers a PUSH_PROMISE header block, decoded only to keep the
// HPACK table in step: the promised stream is refused.
type pushBlock struct {
	block    []byte
	promised uint32
	active   bool
}

// handle processes one frame. An error ends the connection.
func (cc *H2Conn) handle(f http2.Frame, push *pushBlock) error {
	switch f := f.(type) {
	case *http2.SettingsFrame:
		if f.IsAck() {
			return nil
		}
		return cc.handleSettings(f)
	case *http2.WindowUpdateFrame:
		return cc.handleWindowUpdate(f)
	case *http2.PingFrame:
		if f.IsAck() {
			return nil
		}
		cc.lockWrite()
		defer cc.wmu.Unlock()
		if err := cc.fr.WritePing(true, f.Data); err != nil {
			return err
		}
		return cc.flush()
	case *http2.GoAwayFrame:
		cc.mu.Lock()
		cc.closed = true
		for id, cs := range cc.streams {
			if id > f.LastStreamID {
				cs.end(fmt.Errorf("mirror: the origin is closing the connection (GOAWAY): %w", ErrUnprocessed))
			}
		}
		cc.cond.Broadcast()
		cc.mu.Unlock()
	case *http2.MetaHeadersFrame:
		return cc.handleHeaders(f)
	case *http2.DataFrame:
		return cc.handleData(f)
	case *http2.RSTStreamFrame:
		return cc.handleReset(f)
	case *http2.PushPromiseFrame:
		*push = pushBlock{block: append([]byte(nil), f.HeaderBlockFragment()...), promised: f.PromiseID, active: true}
		if f.HeadersEnded() {
			return cc.refusePush(push)
		}
	case *http2.ContinuationFrame:
		if !push.active {
			return http2.ConnectionError(http2.ErrCodeProtocol)
		}
		push.block = append(push.block, f.HeaderBlockFragment()...)
		if len(push.block) > defaultHeaderLimit {
			return http2.ConnectionError(http2.ErrCodeProtocol)
		}
		if f.HeadersEnded() {
			return cc.refusePush(push)
		}
	}
	return nil
}

// handleWindowUpdate grows a send window. One grown past 2^31-1 is the
// origin's flow-control error (RFC 9113 §6.9.1): the connection's ends
// the connection, a stream's the stream.
func (cc *H2Conn) handleWindowUpdate(f *http2.WindowUpdateFrame) error {
	cc.mu.Lock()
	if f.StreamID == 0 {
		cc.sendWindow += int64(f.Increment)
		over := cc.sendWindow > maxWindow
		cc.cond.Broadcast()
		cc.mu.Unlock()
		if over {
			return http2.ConnectionError(http2.ErrCodeFlowControl)
		}
		return nil
	}
	cs := cc.streams[f.StreamID]
	if cs == nil {
		cc.mu.Unlock()
		return nil
	}
	cs.sendWindow += int64(f.Increment)
	over := cs.sendWindow > maxWindow
	if !over {
		cc.cond.Broadcast()
	}
	cc.mu.Unlock()
	if over {
		cs.abort(http2.StreamError{StreamID: cs.id, Code: http2.ErrCodeFlowControl}, http2.ErrCodeFlowControl)
	}
	return nil
}

func (cc *H2Conn) handleReset(f *http2.RSTStreamFrame) error {
	cc.mu.Lock()
	cs := cc.streams[f.StreamID]
	if cs == nil {
		cc.mu.Unlock()
		return nil
	}
	if cs.recvEnded {
		// The origin has answered in full: a reset now only ends our
		// side. NO_ERROR says it wants no more of the request body;
		// another code answers our frames that came after it closed the
		// stream (Go's server sends STREAM_CLOSED for DATA after its
		// handler returned). The response is whole either way, and its
		// reader gets it, as x/net's transport gives it.
		cs.sendEnded = true
		cs.maybeDone()
		cc.mu.Unlock()
		return nil
	}
	err := error(http2.StreamError{StreamID: f.StreamID, Code: f.ErrCode})
	if f.ErrCode == http2.ErrCodeRefusedStream && cs.resp == nil {
		err = fmt.Errorf("mirror: %w: %w", err, ErrUnprocessed)
	}
	// The reset response is cut short: what it left unread is dropped,
	// and credited back to the connection.
	connInc := cs.discard()
	cs.end(err)
	cc.mu.Unlock()
	return cc.writeControl(f.StreamID, 0, 0, connInc)
}

func (cc *H2Conn) refusePush(push *pushBlock) error {
	dec := cc.fr.ReadMetaHeaders
	dec.SetEmitFunc(func(hpack.HeaderField) {})
	if _, err := dec.Write(push.block); err != nil {
		return http2.ConnectionError(http2.ErrCodeCompression)
	}
	if err := dec.Close(); err != nil {
		return http2.ConnectionError(http2.ErrCodeCompression)
	}
	id := push.promised
	*push = pushBlock{}
	cc.lockWrite()
	defer cc.wmu.Unlock()
	if err := cc.fr.WriteRSTStream(id, http2.ErrCodeRefusedStream); err != nil {
		return err
	}
	return cc.flush()
}

func (cc *H2Conn) handleSettings(f *http2.SettingsFrame) error {
	cc.lockWrite()
	defer cc.wmu.Unlock()
	cc.mu.Lock()
	err := f.ForeachSetting(func(s http2.Setting) error {
		if err := s.Valid(); err != nil {
			return err
		}
		switch s.ID {
		case http2.SettingMaxConcurrentStreams:
			cc.peerMaxStreams = s.Val
		case http2.SettingInitialWindowSize:
			delta := int64(s.Val) - cc.peerInitWindow
			cc.peerInitWindow = int64(s.Val)
			for _, cs := range cc.streams {
				cs.sendWindow += delta
				if cs.sendWindow > maxWindow {
					// RFC 9113 §6.9.2: a connection error.
					return http2.ConnectionError(http2.ErrCodeFlowControl)
				}
			}
		case http2.SettingMaxFrameSize:
			cc.peerMaxFrame = s.Val
		case http2.SettingMaxHeaderListSize:
			cc.peerMaxHeaderLst = uint64(s.Val)
		case http2.SettingHeaderTableSize:
			cc.henc.SetMaxDynamicTableSizeLimit(s.Val)
		}
		return nil
	})
	cc.seenSettings = true
	cc.cond.Broadcast()
	cc.mu.Unlock()
	if err != nil {
		return err
	}
	if err := cc.fr.WriteSettingsAck(); err != nil {
		return err
	}
	return cc.flush()
}

// handleHeaders processes a response header block. A stream that fails
// on it is reset at the origin, which would otherwise go on sending.
func (cc *H2Conn) handleHeaders(f *http2.MetaHeadersFrame) error {
	cc.mu.Lock()
	cs := cc.streams[f.StreamID]
	if cs == nil {
		cc.mu.Unlock()
		return nil // a stream already cancelled; the block was decoded all the same
	}
	rst := cs.headers(f)
	cc.mu.Unlock()
	return cc.writeControl(f.StreamID, rst, 0, 0)
}

// headers takes a header block of the stream: the response head, a 1xx,
// or the trailers. It ends the stream with an error if the block is not
// one of those, and returns the RST_STREAM code due then (0: none). mu
// held.
func (cs *h2Stream) headers(f *http2.MetaHeadersFrame) http2.ErrCode {
	cc := cs.cc
	if f.Truncated {
		cs.end(errors.New("mirror: response header list too large"))
		return http2.ErrCodeCancel
	}
	if cs.resp != nil {
		// Trailers.
		if !f.StreamEnded() {
			cs.end(errors.New("mirror: h2 trailers without END_STREAM"))
			return http2.ErrCodeProtocol
		}
		// Kept aside: the reader of the body fills resp.Trailer at EOF,
		// as net/http's transports do, since whoever holds the response
		// may read the map until then.
		if cs.trailer == nil {
			cs.trailer = http.Header{}
		}
		for _, hf := range f.RegularFields() {
			k := http.CanonicalHeaderKey(hf.Name)
			cs.trailer[k] = append(cs.trailer[k], hf.Value)
		}
		cs.recvEnded = true
		cs.readCond.Broadcast()
		return 0
	}
	status, err := strconv.Atoi(f.PseudoValue("status"))
	if err != nil || status < 100 || status > 999 {
		cs.end(errors.New("mirror: h2 response without a valid :status"))
		return http2.ErrCodeProtocol
	}
	if status < 200 {
		if f.StreamEnded() {
			// Nothing can follow on a stream the origin ended: no final
			// response will come.
			cs.end(errors.New("mirror: h2 stream ended with a 1xx informational response"))
			return http2.ErrCodeProtocol
		}
		cs.interim++
		if cs.interim > maxInterim {
			cs.end(fmt.Errorf("mirror: more than %d 1xx informational responses", maxInterim))
			return http2.ErrCodeCancel
		}
		if status == http.StatusContinue && !cs.continued {
			cs.continued = true
			close(cs.continueCh)
		}
		return 0 // interim responses (103 Early Hints) are not passed on
	}
	resp := &http.Response{
		Status:     httpstatus.Line(status),
		StatusCode: status,
		Proto:      "HTTP/2.0",
		ProtoMajor: 2,
		Header:     make(http.Header),
		Trailer:    make(http.Header),
		Request:    cs.req,
		Body:       h2Body{cs},
	}
	for _, hf := range f.RegularFields() {
		k := http.CanonicalHeaderKey(hf.Name)
		resp.Header[k] = append(resp.Header[k], hf.Value)
	}
	for _, t := range resp.Header.Values("Trailer") {
		for _, k := range strings.Split(t, ",") {
			if k = http.CanonicalHeaderKey(strings.TrimSpace(k)); k != "" {
				resp.Trailer[k] = nil
			}
		}
	}
	resp.ContentLength = -1
	if cl := resp.Header.Get("Content-Length"); cl != "" {
		if n, err := strconv.ParseInt(cl, 10, 64); err == nil && n >= 0 {
			resp.ContentLength = n
			cs.wantLen = n
		}
	}
	if cs.req.Method == http.MethodHead || status == http.StatusNoContent || status == http.StatusNotModified {
		cs.wantLen = -1 // no body whatever Content-Length says
		cs.noBody = true
	}
	if f.StreamEnded() {
		cs.recvEnded = true
		if resp.ContentLength < 0 {
			resp.ContentLength = 0
		}
	}
	if s, ok := cc.conn.(interface{ ConnectionState() tls.ConnectionState }); ok {
		st := s.ConnectionState()
		resp.TLS = &st
	}
	cs.resp = resp
	close(cs.respReady)
	if cs.recvEnded {
		cs.maybeDone()
	}
	return 0
}

func (cc *H2Conn) handleData(f *http2.DataFrame) error {
	n := int64(f.Header().Length)
	data := f.Data()
	cc.mu.Lock()
	if n > cc.recvWindow {
		cc.mu.Unlock()
		return http2.ConnectionError(http2.ErrCodeFlowControl)
	}
	cc.recvWindow -= n
	cs := cc.streams[f.StreamID]
	var connInc, streamInc int64
	var rst http2.ErrCode
	switch {
	case cs == nil || cs.recvEnded:
		// A stream already over: its bytes go straight back.
		connInc = cc.consumeConn(n)
	case cs.resp == nil:
		rst = http2.ErrCodeProtocol
		connInc = cc.consumeConn(n) + cs.discard()
		cs.end(errors.New("mirror: h2 DATA before the response headers"))
	case cs.noBody && len(data) > 0:
		// RFC 9113 §8.1.1: content on a response that has none is
		// malformed; passed on, it would become a body no client expects.
		rst = http2.ErrCodeProtocol
		connInc = cc.consumeConn(n) + cs.discard()
		cs.end(errors.New("mirror: h2 DATA on a response that has no content (HEAD, 204 or 304)"))
	case n > cs.recvWindow:
		rst = http2.ErrCodeFlowControl
		connInc = cc.consumeConn(n) + cs.discard()
		cs.end(http2.StreamError{StreamID: cs.id, Code: http2.ErrCodeFlowControl})
	default:
		cs.recvWindow -= n
		if pad := n - int64(len(data)); pad > 0 {
			// Padding is flow-controlled but never read: credit it now,
			// or frames of padding alone would use the window up (the
			// stream's, unless this frame ends it).
			connInc = cc.consumeConn(pad)
			if !f.StreamEnded() {
				streamInc = cs.credit(pad)
			}
		}
		if len(data) > 0 {
			cs.buf = append(cs.buf, append([]byte(nil), data...))
			cs.bufLen += int64(len(data))
			cs.gotLen += int64(len(data))
		}
		if cs.wantLen >= 0 && cs.gotLen > cs.wantLen {
			rst = http2.ErrCodeProtocol
			// This frame's bytes and all still unread go back to the
			// connection: the stream is over.
			connInc += cs.discard()
			cs.end(fmt.Errorf("mirror: response body longer than its Content-Length %d", cs.wantLen))
		} else if f.StreamEnded() {
			cs.recvEnded = true
		}
		cs.readCond.Broadcast()
	}
	cc.mu.Unlock()
	return cc.writeControl(f.StreamID, rst, streamInc, connInc)
}
