package mirror

import (
	"errors"
	"io"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// TestH2LostBeforeAnyResponse: a connection that ends under a stream the
// origin never answered fails that stream with ErrNoResponse, so that a
// caller can send a repeatable request again on a new connection, as it
// does on HTTP/1.1. A stream that had its response fails without it.
func TestH2LostBeforeAnyResponse(t *testing.T) {
	cc, p := newPeer(t, nil)
	type result struct {
		err     error
		bodyErr error
	}
	send := func() <-chan result {
		res := make(chan result, 1)
		go func() {
			resp, err := cc.RoundTrip(newRequest(t, ctxTimeout(t, 10*time.Second), "GET", "https://peer.test/", nil))
			if err != nil {
				res <- result{err: err}
				return
			}
			_, err = io.ReadAll(resp.Body)
			res <- result{bodyErr: err}
		}()
		return res
	}
	answered := send()
	h := p.next(http2.FrameHeaders).(*http2.MetaHeadersFrame)
	p.respond(h.StreamID, false, ":status", "200")
	p.fr.WriteData(h.StreamID, false, []byte("half"))
	unanswered := send()
	p.next(http2.FrameHeaders)
	p.conn.Close()

	if r := <-unanswered; !errors.Is(r.err, ErrNoResponse) {
		t.Errorf("unanswered stream: %v, want ErrNoResponse", r.err)
	}
	r := <-answered
	if r.err != nil || r.bodyErr == nil || errors.Is(r.bodyErr, ErrNoResponse) {
		t.Errorf("answered stream: err %v, body err %v; want its response, then a body error that is not ErrNoResponse", r.err, r.bodyErr)
	}
}

// TestH2PingAfterIdle: a request on a connection that read nothing for the
// ping timeout goes out behind a PING; an origin that answers nothing
// within the timeout is taken for dead, and the request fails with
// ErrNoResponse at once instead of waiting for its deadline. A request on
// a connection that is not idle sends no PING.
func TestH2PingAfterIdle(t *testing.T) {
	const timeout = 200 * time.Millisecond
	cc, p := newPeerWith(t, nil, Options{PingTimeout: timeout})
	first := make(chan error, 1)
	go func() {
		resp, err := cc.RoundTrip(newRequest(t, ctxTimeout(t, 10*time.Second), "GET", "https://peer.test/1", nil))
		if err == nil {
			_, err = io.ReadAll(resp.Body)
		}
		first <- err
	}()
	if f := p.next(http2.FramePing, http2.FrameHeaders); f.Header().Type != http2.FrameHeaders {
		t.Fatalf("fresh connection: %v before the first request", f.Header().Type)
	}
	p.respond(1, true, ":status", "204")
	if err := <-first; err != nil {
		t.Fatal(err)
	}

	time.Sleep(timeout + 100*time.Millisecond) // idle past the timeout
	ctx := ctxTimeout(t, 10*time.Second)
	second := make(chan error, 1)
	go func() {
		_, err := cc.RoundTrip(newRequest(t, ctx, "GET", "https://peer.test/2", nil))
		second <- err
	}()
	f := p.next(http2.FramePing, http2.FrameHeaders)
	if ping, ok := f.(*http2.PingFrame); !ok || ping.IsAck() {
		t.Fatalf("after idling: %v first, want a PING ahead of the request", f.Header().Type)
	}
	p.next(http2.FrameHeaders)
	// Silent: neither the PING nor the request is answered.
	err := <-second
	if !errors.Is(err, ErrNoResponse) || ctx.Err() != nil {
		t.Fatalf("request on a silent connection: %v (ctx %v), want ErrNoResponse before the deadline", err, ctx.Err())
	}
	if cc.CanTakeRequest() {
		t.Error("the silent connection still takes requests")
	}
}

// TestH2PingAnsweredSlowOrigin: an origin that answers the PING is alive,
// however long it then takes over the response.
func TestH2PingAnsweredSlowOrigin(t *testing.T) {
	const timeout = 200 * time.Millisecond
	cc, p := newPeerWith(t, nil, Options{PingTimeout: timeout})
	// The client has read the peer's SETTINGS (and this PING) before the
	// idle time starts: read late on a loaded machine, they made the
	// connection too fresh for a PING, and the peer waited for one.
	p.sync()
	time.Sleep(timeout + 100*time.Millisecond)
	res := make(chan error, 1)
	go func() {
		resp, err := cc.RoundTrip(newRequest(t, ctxTimeout(t, 10*time.Second), "GET", "https://peer.test/", nil))
		if err == nil {
			_, err = io.ReadAll(resp.Body)
		}
		res <- err
	}()
	ping, ok := p.next(http2.FramePing).(*http2.PingFrame)
	if !ok {
		t.Fatal("no PING")
	}
	p.fr.WritePing(true, ping.Data)
	h := p.next(http2.FrameHeaders).(*http2.MetaHeadersFrame)
	time.Sleep(3 * timeout) // slow, but it answered the PING
	p.respond(h.StreamID, false, ":status", "200")
	p.fr.WriteData(h.StreamID, true, []byte("slow"))
	if err := <-res; err != nil {
		t.Fatalf("slow origin that answered the PING: %v", err)
	}
}

// TestH2PingOff: a negative timeout sends no PING, however long the
// connection idled.
func TestH2PingOff(t *testing.T) {
	cc, p := newPeerWith(t, nil, Options{PingTimeout: -1})
	time.Sleep(50 * time.Millisecond)
	res := make(chan error, 1)
	go func() {
		_, err := cc.RoundTrip(newRequest(t, ctxTimeout(t, 10*time.Second), "GET", "https://peer.test/", nil))
		res <- err
	}()
	if f := p.next(http2.FramePing, http2.FrameHeaders); f.Header().Type != http2.FrameHeaders {
		t.Fatalf("pings off: %v first", f.Header().Type)
	}
	p.respond(1, true, ":status", "204")
	if err := <-res; err != nil {
		t.Fatal(err)
	}
}
