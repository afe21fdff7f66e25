package mirror

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
)

// TestGoAwayKeepsUploadGoing: a graceful GOAWAY whose last stream id
// covers an upload in progress (nginx reload, Go's Server.Shutdown)
// promises the origin will finish that stream. The rest of the request
// body still goes out once the origin opens its window, END_STREAM
// included (the body writer once stopped at the GOAWAY, and the origin
// waited for the body, the client for the response).
func TestGoAwayKeepsUploadGoing(t *testing.T) {
	cc, p := newPeer(t, nil)
	const size = 100000 // more than the initial 65535-byte windows
	req := newRequest(t, ctxTimeout(t, 10*time.Second), "POST", "https://peer.test/upload", nil)
	req.Body, req.ContentLength = io.NopCloser(bytes.NewReader(make([]byte, size))), size
	errc := make(chan error, 1)
	go func() {
		resp, err := cc.RoundTrip(req)
		if err == nil {
			_, err = io.ReadAll(resp.Body)
			resp.Body.Close()
		}
		errc <- err
	}()
	h := p.next(http2.FrameHeaders)
	id := h.Header().StreamID
	got := 0
	for got < initialWindow {
		d := p.next(http2.FrameData).(*http2.DataFrame)
		got += len(d.Data())
	}
	// The writer now waits for credit. The origin drains: it will finish
	// this stream, no new one.
	p.fr.WriteGoAway(id, http2.ErrCodeNo, nil)
	p.fr.WriteWindowUpdate(0, size)
	p.fr.WriteWindowUpdate(id, size)

	p.conn.SetReadDeadline(time.Now().Add(2 * time.Second))
	ended := false
	for !ended {
		f, err := p.fr.ReadFrame()
		if err != nil {
			t.Fatalf("after GOAWAY the upload stalled at %d of %d bytes without END_STREAM: %v", got, size, err)
		}
		if d, ok := f.(*http2.DataFrame); ok && d.StreamID == id {
			got += len(d.Data())
			ended = d.StreamEnded()
		}
	}
	p.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	if got != size {
		t.Errorf("the origin got %d bytes, want %d", got, size)
	}
	p.respond(id, true, ":status", "204")
	if err := <-errc; err != nil {
		t.Errorf("request: %v", err)
	}
}

// TestInterimWithEndStream: a 1xx response with END_STREAM ends the
// origin's side of the stream: no final response can follow. The request
// fails at once (x/net: "1xx informational response with END_STREAM
// flag") instead of waiting, until the caller's deadline, for a response
// that never comes.
func TestInterimWithEndStream(t *testing.T) {
	cc, p := newPeer(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		resp, err := cc.RoundTrip(newRequest(t, ctx, "GET", "https://peer.test/", nil))
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	h := p.next(http2.FrameHeaders)
	p.respond(h.Header().StreamID, true, ":status", "103", "link", "</a.css>; rel=preload")
	start := time.Now()
	err := <-errc
	if err == nil {
		t.Fatal("a stream ended by a 1xx gave a response")
	}
	if errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the request hung %v until its deadline: %v", time.Since(start).Round(time.Millisecond), err)
	}
}

// TestStrandedWindowUpdate: a writer whose flush is skipped because
// another writer waits for wmu relies on that writer to flush. RoundTrip
// once returned without flushing on two paths (the request's header list
// over the origin's SETTINGS_MAX_HEADER_LIST_SIZE; the connection closed,
// as after GOAWAY). Frames left in the buffer then, here the WINDOW_UPDATE
// a body reader owes the origin, stayed there: the origin, out of credit,
// stopped, and the reader waited forever on a live connection.
//
// The interleaving (reader queued on wmu, then the failing RoundTrip
// queued behind it) happens under load; the test holds wmu itself only
// to line the two up deterministically.
func TestStrandedWindowUpdate(t *testing.T) {
	// Windows of 65535: a reader owes credit after 32767 bytes.
	pre := &fingerprint.H2{Settings: []fingerprint.Setting{{ID: 4, Val: 65535}}, PseudoOrder: []string{":method", ":authority", ":scheme", ":path"}}
	cc, p := newPeer(t, pre)
	// The origin takes header lists up to 1000 bytes.
	p.fr.WriteSettings(http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: 1000})

	ctx := ctxTimeout(t, 10*time.Second)
	type result struct {
		resp *http.Response
		err  error
	}
	res := make(chan result, 1)
	go func() {
		resp, err := cc.RoundTrip(newRequest(t, ctx, "GET", "https://peer.test/a", nil))
		res <- result{resp, err}
	}()
	h := p.next(http2.FrameHeaders)
	id := h.Header().StreamID
	p.respond(id, false, ":status", "200")
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.resp.Body.Close()
	// The whole stream window.
	for sent := 0; sent < 65535; {
		k := min(16000, 65535-sent)
		p.fr.WriteData(id, false, make([]byte, k))
		sent += k
	}
	// Wait until the client has it all buffered.
	deadline := time.Now().Add(5 * time.Second)
	for {
		cc.mu.Lock()
		cs := cc.streams[id]
		n := int64(0)
		if cs != nil {
			n = cs.bufLen
		}
		maxHL := cc.peerMaxHeaderLst
		cc.mu.Unlock()
		if n == 65535 && maxHL == 1000 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("buffered %d, peer header limit %d", n, maxHL)
		}
		time.Sleep(time.Millisecond)
	}

	cc.lockWrite() // some writer busy on the connection
	read := make(chan error, 1)
	go func() {
		_, err := io.ReadFull(r.resp.Body, make([]byte, 65535)) // owes credit: queues on wmu
		read <- err
	}()
	waitQueued(t, cc, 1)
	big := make(chan error, 1)
	go func() {
		req := newRequest(t, ctx, "GET", "https://peer.test/b", nil)
		req.Header.Set("X-Big", strings.Repeat("b", 2000))
		_, err := cc.RoundTrip(req) // fails: over the origin's limit
		big <- err
	}()
	waitQueued(t, cc, 2)
	cc.wmu.Unlock()
	if err := <-read; err != nil {
		t.Fatal(err)
	}
	if err := <-big; !errors.Is(err, errHeaderListSize) {
		t.Fatalf("oversized request: %v", err)
	}

	// The origin waits for credit to send the rest.
	p.conn.SetReadDeadline(time.Now().Add(2 * time.Second))
	for {
		f, err := p.fr.ReadFrame()
		if err != nil {
			cc.wmu.Lock()
			left := cc.bw.Buffered()
			cc.wmu.Unlock()
			t.Fatalf("the reader consumed the whole window but no WINDOW_UPDATE reached the origin (%d bytes left in the write buffer): %v", left, err)
		}
		if wu, ok := f.(*http2.WindowUpdateFrame); ok && wu.StreamID == id {
			break
		}
	}
}

func waitQueued(t *testing.T, cc *H2Conn, n int32) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for cc.queued.Load() < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d writers queued, want %d", cc.queued.Load(), n)
		}
		time.Sleep(time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond) // parked in the mutex's queue, in order
}

// TestH2MaxResponseHeaderBytes: Options.MaxResponseHeaderBytes bounds
// HTTP/2 heads as it does HTTP/1.1 ones, not only the client's
// SETTINGS_MAX_HEADER_LIST_SIZE (10 MiB when it sent none).
func TestH2MaxResponseHeaderBytes(t *testing.T) {
	cc, p := newPeerWith(t, nil, Options{MaxResponseHeaderBytes: 4096})
	errc := make(chan error, 1)
	go func() {
		resp, err := cc.RoundTrip(newRequest(t, ctxTimeout(t, 10*time.Second), "GET", "https://peer.test/", nil))
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	h := p.next(http2.FrameHeaders)
	big := p.block(":status", "200", "x-big", strings.Repeat("h", 15000))
	p.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: h.Header().StreamID, BlockFragment: big, EndHeaders: true, EndStream: true})
	if err := <-errc; err == nil {
		t.Error("a 15 KB response head passed a MaxResponseHeaderBytes of 4096")
	}
}

// TestPaddingOnlyDataIsCredited: padding counts against the stream window
// and is credited back without waiting for a Read, which DATA frames of
// padding alone never give: the stream's WINDOW_UPDATE goes out, as
// x/net's transport sends it, instead of the stream running out of credit.
func TestPaddingOnlyDataIsCredited(t *testing.T) {
	pre := &fingerprint.H2{Settings: []fingerprint.Setting{{ID: 4, Val: 65535}}, WindowUpdate: 1 << 20}
	cc, p := newPeer(t, pre)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		resp, err := cc.RoundTrip(newRequest(t, ctx, "GET", "https://peer.test/", nil))
		if err == nil {
			_, err = io.ReadAll(resp.Body)
			resp.Body.Close()
		}
		errc <- err
	}()
	id := p.next(http2.FrameHeaders).Header().StreamID
	p.respond(id, false, ":status", "200")
	pad := make([]byte, 255)
	window := 65535
	for window >= 256 {
		p.fr.WriteDataPadded(id, false, nil, pad)
		window -= 256
	}
	// The origin needs stream credit to send the body.
	p.conn.SetReadDeadline(time.Now().Add(2 * time.Second))
	for {
		f, err := p.fr.ReadFrame()
		if err != nil {
			t.Fatalf("no stream WINDOW_UPDATE for %d bytes of padding: %v", 65535-window, err)
		}
		if wu, ok := f.(*http2.WindowUpdateFrame); ok && wu.StreamID == id {
			break
		}
	}
	p.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	p.fr.WriteData(id, true, []byte("ok"))
	if err := <-errc; err != nil {
		t.Error(err)
	}
}

// TestStreamWindowOverflow: a WINDOW_UPDATE that grows a stream's send
// window past 2^31-1 is the origin's flow-control error (RFC 9113
// §6.9.1): the stream is reset with FLOW_CONTROL_ERROR and its request
// fails, while the connection goes on.
func TestStreamWindowOverflow(t *testing.T) {
	cc, p := newPeer(t, nil)
	errc := make(chan error, 1)
	go func() {
		resp, err := cc.RoundTrip(newRequest(t, ctxTimeout(t, 10*time.Second), "GET", "https://peer.test/", nil))
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	id := p.next(http2.FrameHeaders).Header().StreamID
	if err := p.fr.WriteWindowUpdate(id, 1<<31-1); err != nil {
		t.Fatal(err)
	}
	var se http2.StreamError
	if err := <-errc; !errors.As(err, &se) || se.Code != http2.ErrCodeFlowControl {
		t.Fatalf("request error %v, want the stream's FLOW_CONTROL_ERROR", err)
	}
	if w := p.sync(); w.rst[id] != http2.ErrCodeFlowControl {
		t.Fatalf("stream reset with %v, want FLOW_CONTROL_ERROR", w.rst[id])
	}
	if !cc.CanTakeRequest() {
		t.Fatal("the connection closed for one stream's error")
	}
}

// TestDataOnHeadIsMalformed: DATA on the response to a HEAD is malformed
// (RFC 9113 §8.1.1). The stream is reset with PROTOCOL_ERROR and the
// bytes never become a body; they were passed on as one.
func TestDataOnHeadIsMalformed(t *testing.T) {
	cc, p := newPeer(t, nil)
	type result struct {
		body []byte
		err  error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := cc.RoundTrip(newRequest(t, ctxTimeout(t, 10*time.Second), "HEAD", "https://peer.test/", nil))
		if err != nil {
			done <- result{err: err}
			return
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- result{b, err}
	}()
	id := p.next(http2.FrameHeaders).Header().StreamID
	p.respond(id, false, ":status", "200", "content-length", "5")
	if err := p.fr.WriteData(id, true, []byte("hello")); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if len(r.body) != 0 {
		t.Fatalf("a HEAD response gave a body of %q", r.body)
	}
	if w := p.sync(); w.rst[id] != http2.ErrCodeProtocol {
		t.Fatalf("stream reset with %v, want PROTOCOL_ERROR", w.rst[id])
	}
}
