package mirror

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// newPeerWith is newPeer with the H2Conn's Options given. Once the test
// and its cleanups are over (the connection closed), no goroutine it
// started may be left: a request body writer, a read loop.
func newPeerWith(t *testing.T, pre *fingerprint.H2, opts Options) (*H2Conn, *peer) {
	t.Helper()
	before := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, before) }) // runs last
	c, sc := testkit.TCPPair(t)
	sc.SetDeadline(time.Now().Add(20 * time.Second))
	p := &peer{t: t, conn: sc}
	p.fr = http2.NewFramer(sc, sc)
	p.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	p.enc = hpack.NewEncoder(&p.hbuf)
	got := make(chan error, 1)
	go func() {
		buf := make([]byte, len(http2.ClientPreface))
		_, err := io.ReadFull(sc, buf)
		got <- err
	}()
	cc, err := NewH2Conn(c, pre, opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	p.fr.WriteSettings()
	t.Cleanup(func() {
		cc.Close()
		sc.Close()
	})
	return cc, p
}

// wire is what the client wrote, as a peer's sync saw it.
type wire struct {
	credit int64                        // connection WINDOW_UPDATE increments
	rst    map[uint32]http2.ErrCode     // RST_STREAM codes by stream
	frames map[uint32][]http2.FrameType // frame types by stream, in order
}

func newWire() wire {
	return wire{rst: map[uint32]http2.ErrCode{}, frames: map[uint32][]http2.FrameType{}}
}

var pingSeq atomic.Uint64

// sync sends a PING and reads until its answer: the client wrote
// everything it had written before the PING arrived by then, in order,
// so what a synchronous call (a Close, a frame the read loop handled)
// wrote is in the result without waiting on a clock.
func (p *peer) sync() wire {
	p.t.Helper()
	var data [8]byte
	copy(data[:], fmt.Sprint(pingSeq.Add(1)))
	if err := p.fr.WritePing(false, data); err != nil {
		p.t.Fatalf("peer: ping: %v", err)
	}
	w := newWire()
	for {
		f, err := p.fr.ReadFrame()
		if err != nil {
			p.t.Fatalf("peer: %v", err)
		}
		id := f.Header().StreamID
		if id != 0 {
			w.frames[id] = append(w.frames[id], f.Header().Type)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				p.fr.WriteSettingsAck()
			}
		case *http2.PingFrame:
			if f.IsAck() && f.Data == data {
				return w
			}
		case *http2.WindowUpdateFrame:
			if id == 0 {
				w.credit += int64(f.Increment)
			}
		case *http2.RSTStreamFrame:
			w.rst[id] = f.ErrCode
		}
	}
}

// sendData sends DATA frames on stream id counting n bytes against the
// flow-control windows, the last of them padded (padding and its length
// byte count too).
func (p *peer) sendData(id uint32, n int, end bool) {
	p.t.Helper()
	const frame = 16000 // below the client's SETTINGS_MAX_FRAME_SIZE
	for n > 0 {
		k := min(n, frame)
		n -= k
		var err error
		if n == 0 && k > 256 {
			pad := make([]byte, 200)
			err = p.fr.WriteDataPadded(id, end, make([]byte, k-1-len(pad)), pad)
		} else {
			err = p.fr.WriteData(id, end && n == 0, make([]byte, k))
		}
		if err != nil {
			p.t.Fatalf("peer: data: %v", err)
		}
	}
}

// smallConnWindow announces a connection window of 65535 bytes, so that
// credit goes back once 32767 are consumed, and stream windows large
// enough to stay out of the way.
var smallConnWindow = &fingerprint.H2{Settings: []fingerprint.Setting{{ID: 4, Val: 1 << 20}}}

// add merges what a later sync saw into w.
func (w *wire) add(o wire) {
	w.credit += o.credit
	for id, code := range o.rst {
		w.rst[id] = code
	}
	for id, fs := range o.frames {
		w.frames[id] = append(w.frames[id], fs...)
	}
}

// TestH2ConnWindowCredited: response bytes a stream received but nobody
// will read (the body closed early, the stream reset by the origin, DATA
// beyond Content-Length) go back to the connection window, padding
// included, each byte once. Before, they were dropped uncredited and a
// connection stalled for good after enough of them.
func TestH2ConnWindowCredited(t *testing.T) {
	const sent = 40000 // above half the connection window: credit is due at once
	cases := []struct {
		name   string
		length string // the response's Content-Length, if any
		// run sends the response to a GET on stream id DATA and makes
		// those bytes unreadable. settle is the peer's sync, its
		// findings counted.
		run     func(t *testing.T, p *peer, settle func(), id uint32, body io.ReadCloser)
		wantRST http2.ErrCode // the client's RST_STREAM for the stream (0: none)
	}{
		{"close complete body", "", func(t *testing.T, p *peer, settle func(), id uint32, body io.ReadCloser) {
			p.sendData(id, sent, true)
			settle() // the client has the whole body buffered
			if _, err := io.ReadFull(body, make([]byte, 100)); err != nil {
				t.Fatal(err)
			}
			body.Close()
		}, 0},
		{"close incomplete body", "1000000", func(t *testing.T, p *peer, settle func(), id uint32, body io.ReadCloser) {
			p.sendData(id, sent, false)
			settle()
			body.Close()
		}, http2.ErrCodeCancel},
		{"reset by the origin", "1000000", func(t *testing.T, p *peer, settle func(), id uint32, body io.ReadCloser) {
			p.sendData(id, sent, false)
			p.fr.WriteRSTStream(id, http2.ErrCodeInternal)
			settle()
			if _, err := io.ReadAll(body); err == nil {
				t.Error("a reset body read cleanly")
			}
		}, 0},
		{"longer than Content-Length", "10", func(t *testing.T, p *peer, settle func(), id uint32, body io.ReadCloser) {
			p.sendData(id, sent, false)
		}, http2.ErrCodeProtocol},
		{"close after a stream error", "1000000", func(t *testing.T, p *peer, settle func(), id uint32, body io.ReadCloser) {
			p.sendData(id, sent, false)
			// Trailers without END_STREAM end the stream with an error,
			// the bytes before them still readable; Close drops them.
			p.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: p.block("x-t", "1"), EndHeaders: true})
			settle()
			body.Close()
		}, http2.ErrCodeProtocol},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cc, p := newPeerWith(t, smallConnWindow, Options{})
			type result struct {
				resp *http.Response
				err  error
			}
			res := make(chan result, 1)
			go func() {
				resp, err := cc.RoundTrip(newRequest(t, ctxTimeout(t, 10*time.Second), "GET", "https://peer.test/", nil))
				res <- result{resp, err}
			}()
			id := p.next(http2.FrameHeaders).Header().StreamID
			fields := []string{":status", "200"}
			if c.length != "" {
				fields = append(fields, "content-length", c.length)
			}
			p.respond(id, false, fields...)
			r := <-res
			if r.err != nil {
				t.Fatal(r.err)
			}
			seen := p.sync()
			c.run(t, p, func() { seen.add(p.sync()) }, id, r.resp.Body)
			seen.add(p.sync())
			if seen.credit != sent {
				t.Errorf("connection credit %d, want %d: every byte received goes back once", seen.credit, sent)
			}
			if got := seen.rst[id]; got != c.wantRST {
				t.Errorf("RST_STREAM %v, want %v", got, c.wantRST)
			}
			r.resp.Body.Close()
			if w := p.sync(); w.credit != 0 || len(w.rst) != 0 {
				t.Errorf("Close after the stream ended wrote credit %d, resets %v", w.credit, w.rst)
			}
			cc.mu.Lock()
			n := len(cc.streams)
			cc.mu.Unlock()
			if n != 0 {
				t.Errorf("%d streams left open", n)
			}
		})
	}
}

// TestH2WriteDeadlineAfterIdle: a header block larger than the write
// buffer, sent after the connection idled longer than WriteTimeout, goes
// out. Before, the buffer's own writes ran under the deadline of the last
// flush, long past, and failed the connection with an i/o timeout.
func TestH2WriteDeadlineAfterIdle(t *testing.T) {
	const timeout = 200 * time.Millisecond
	cc, p := newPeerWith(t, nil, Options{WriteTimeout: timeout})
	do := func(header int) error {
		t.Helper()
		req := newRequest(t, ctxTimeout(t, 10*time.Second), "GET", "https://peer.test/", nil)
		if header > 0 {
			req.Header.Set("X-Big", strings.Repeat("a", header))
		}
		errc := make(chan error, 1)
		go func() {
			resp, err := cc.RoundTrip(req)
			if err == nil {
				_, err = io.ReadAll(resp.Body)
				resp.Body.Close()
			}
			errc <- err
		}()
		var h *http2.MetaHeadersFrame
		for h == nil {
			f, err := p.fr.ReadFrame()
			if err != nil {
				// The client gave up on the connection: its error says why.
				return fmt.Errorf("peer: %v; client: %w", err, <-errc)
			}
			h, _ = f.(*http2.MetaHeadersFrame)
		}
		got := 0
		for _, f := range h.RegularFields() {
			if f.Name == "x-big" {
				got = len(f.Value)
			}
		}
		if got != header {
			t.Errorf("the origin got an x-big of %d bytes, want %d", got, header)
		}
		p.respond(h.StreamID, true, ":status", "204")
		return <-errc
	}
	if err := do(0); err != nil {
		t.Fatal(err)
	}
	p.sync() // the client's last write is done
	time.Sleep(3 * timeout)
	if err := do(100 << 10); err != nil {
		t.Fatalf("after idling: %v", err)
	}
	if err := do(0); err != nil {
		t.Fatalf("after the large header block: %v", err)
	}
}

// closeNotifier is a request body that tells when it is closed.
type closeNotifier struct {
	io.Reader
	once   sync.Once
	closed chan struct{}
}

func (c *closeNotifier) Close() error {
	c.once.Do(func() { close(c.closed) })
	return nil
}

// TestH2ExpectAnsweredFirst: an origin that gives its final answer to an
// Expect: 100-continue request without asking for the body gets no body;
// the response reads in full, and the stream, whose END_STREAM never went
// out, is reset (CANCEL) once it has been read, without waiting for a
// Close. Before, the stream was reset at once and the read failed with
// "the origin answered before the body".
func TestH2ExpectAnsweredFirst(t *testing.T) {
	// The go-ahead's timeout must not run out first and send the body.
	cc, p := newPeerWith(t, nil, Options{ExpectContinueTimeout: time.Minute})
	body := &closeNotifier{Reader: bytes.NewReader(make([]byte, 100000)), closed: make(chan struct{})}
	req := newRequest(t, ctxTimeout(t, 10*time.Second), "POST", "https://peer.test/upload", nil)
	req.Body, req.ContentLength = body, 100000
	req.Header.Set("Expect", "100-continue")
	type result struct {
		body string
		err  error
	}
	res := make(chan result, 1)
	var resp *http.Response
	go func() {
		var err error
		resp, err = cc.RoundTrip(req)
		if err != nil {
			res <- result{err: err}
			return
		}
		b, err := io.ReadAll(resp.Body)
		res <- result{string(b), err}
	}()
	h := p.next(http2.FrameHeaders).(*http2.MetaHeadersFrame)
	if h.StreamEnded() {
		t.Fatal("a request with a body sent END_STREAM on its HEADERS")
	}
	id := h.StreamID
	p.respond(id, false, ":status", "401")
	// The body comes once the client has given up the request body (it
	// closes it then), so that what it did on giving up is what the
	// response meets.
	select {
	case <-body.closed:
	case <-time.After(10 * time.Second):
		t.Fatal("the request body was not given up")
	}
	p.fr.WriteData(id, true, []byte("please log in"))
	if r := <-res; r.err != nil || r.body != "please log in" {
		t.Fatalf("response body %q, error %v", r.body, r.err)
	}
	// The reset comes by itself, the body unclosed; nothing before it.
	seen := newWire()
	for seen.rst[id] == 0 {
		seen.add(p.sync())
	}
	if seen.rst[id] != http2.ErrCodeCancel || len(seen.frames[id]) != 1 {
		t.Errorf("the client wrote %v on the stream, reset with %v; want RST_STREAM CANCEL alone", seen.frames[id], seen.rst[id])
	}
	resp.Body.Close()
	if w := p.sync(); len(w.frames) != 0 {
		t.Errorf("Close wrote %v", w.frames)
	}
	cc.mu.Lock()
	n := len(cc.streams)
	cc.mu.Unlock()
	if n != 0 {
		t.Errorf("%d streams left open", n)
	}
}

// TestH2TooManyInterim: a request fails after more than five 1xx
// responses, as in net/http, and its stream is reset; five are passed
// over. Before, an origin could send them without end.
func TestH2TooManyInterim(t *testing.T) {
	const limit = 5 // net/http's
	cc, p := newPeerWith(t, nil, Options{})
	for _, interim := range []int{limit, limit + 1} {
		res := make(chan error, 1)
		go func() {
			resp, err := cc.RoundTrip(newRequest(t, ctxTimeout(t, 10*time.Second), "GET", "https://peer.test/", nil))
			if err == nil {
				resp.Body.Close()
			}
			res <- err
		}()
		id := p.next(http2.FrameHeaders).Header().StreamID
		for range interim {
			p.respond(id, false, ":status", "103", "link", "</a.css>; rel=preload")
		}
		p.respond(id, true, ":status", "204")
		err := <-res
		w := p.sync()
		if interim <= limit {
			if err != nil || w.rst[id] != 0 {
				t.Errorf("%d 1xx: error %v, RST_STREAM %v", interim, err, w.rst[id])
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), "1xx") {
			t.Errorf("%d 1xx: error %v", interim, err)
		}
		if w.rst[id] != http2.ErrCodeCancel {
			t.Errorf("%d 1xx: RST_STREAM %v, want CANCEL", interim, w.rst[id])
		}
	}
	if !cc.CanTakeRequest() {
		t.Error("the connection did not survive")
	}
}

// TestH2ResetAfterACompleteResponse: an origin that answered in full while
// the request body was still on its way, and then resets the stream (Go's
// server answers DATA that comes after its handler returned with
// RST_STREAM STREAM_CLOSED), leaves the response whole for its reader.
// Before, the reset dropped the buffered body and the reader got the
// stream error.
func TestH2ResetAfterACompleteResponse(t *testing.T) {
	for _, code := range []http2.ErrCode{http2.ErrCodeNo, http2.ErrCodeStreamClosed, http2.ErrCodeInternal} {
		t.Run(code.String(), func(t *testing.T) {
			cc, p := newPeerWith(t, smallConnWindow, Options{})
			pr, pw := io.Pipe()
			defer pw.Close()
			req := newRequest(t, ctxTimeout(t, 10*time.Second), "POST", "https://peer.test/", nil)
			req.Body, req.ContentLength = pr, -1
			type result struct {
				resp *http.Response
				err  error
			}
			res := make(chan result, 1)
			go func() {
				resp, err := cc.RoundTrip(req)
				res <- result{resp, err}
			}()
			id := p.next(http2.FrameHeaders).Header().StreamID
			p.respond(id, false, ":status", "200", "content-length", "5")
			r := <-res
			if r.err != nil {
				t.Fatal(r.err)
			}
			defer r.resp.Body.Close()
			p.fr.WriteData(id, true, []byte("hello"))
			p.fr.WriteRSTStream(id, code)
			p.sync()
			b, err := io.ReadAll(r.resp.Body)
			if err != nil || string(b) != "hello" {
				t.Fatalf("body %q, %v; want the whole response", b, err)
			}
		})
	}
}
