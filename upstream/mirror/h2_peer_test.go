package mirror

import (
	"bytes"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// peer is the server side of a cleartext HTTP/2 connection, scripted by
// a test frame by frame.
type peer struct {
	t    *testing.T
	conn net.Conn
	fr   *http2.Framer
	enc  *hpack.Encoder
	hbuf bytes.Buffer
}

// newPeer connects an H2Conn to a scripted peer over loopback TCP. The
// peer has read the client's preface and sent an empty SETTINGS.
func newPeer(t *testing.T, pre *fingerprint.H2) (*H2Conn, *peer) {
	t.Helper()
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
	cc, err := NewH2Conn(c, pre, Options{})
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

func (p *peer) block(fields ...string) []byte {
	p.hbuf.Reset()
	for i := 0; i < len(fields); i += 2 {
		p.enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
	}
	return append([]byte(nil), p.hbuf.Bytes()...)
}

// next returns the next frame of one of the types (others are skipped,
// SETTINGS acknowledged).
func (p *peer) next(types ...http2.FrameType) http2.Frame {
	p.t.Helper()
	for {
		f, err := p.fr.ReadFrame()
		if err != nil {
			p.t.Fatalf("peer: %v", err)
		}
		if s, ok := f.(*http2.SettingsFrame); ok && !s.IsAck() {
			p.fr.WriteSettingsAck()
		}
		for _, typ := range types {
			if f.Header().Type == typ {
				return f
			}
		}
	}
}

func (p *peer) respond(stream uint32, end bool, fields ...string) {
	p.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: stream, BlockFragment: p.block(fields...), EndHeaders: true, EndStream: end})
}

// TestH2PushPromiseKeepsHPACK: a pushed stream is refused, and its header
// block still updates the HPACK table the response after it refers to.
func TestH2PushPromiseKeepsHPACK(t *testing.T) {
	cc, p := newPeer(t, nil)
	type result struct {
		secret, body string
		err          error
	}
	res := make(chan result, 1)
	go func() {
		resp, err := cc.RoundTrip(newRequest(t, ctxTimeout(t, 10*time.Second), "GET", "https://peer.test/", nil))
		if err != nil {
			res <- result{err: err}
			return
		}
		b, err := io.ReadAll(resp.Body)
		res <- result{resp.Header.Get("X-Secret"), string(b), err}
	}()
	h := p.next(http2.FrameHeaders).(*http2.MetaHeadersFrame)
	p.fr.WritePushPromise(http2.PushPromiseParam{StreamID: h.StreamID, PromiseID: 2, EndHeaders: true,
		BlockFragment: p.block(":method", "GET", ":path", "/pushed", ":scheme", "https", ":authority", "peer.test", "x-secret", "s3cr3t")})
	p.respond(h.StreamID, false, ":status", "200", "x-secret", "s3cr3t") // an index into the table the push filled
	p.fr.WriteData(h.StreamID, true, []byte("hi"))
	rst := p.next(http2.FrameRSTStream).(*http2.RSTStreamFrame)
	if rst.StreamID != 2 || rst.ErrCode != http2.ErrCodeRefusedStream {
		t.Errorf("RST_STREAM %d %v, want 2 REFUSED_STREAM", rst.StreamID, rst.ErrCode)
	}
	if r := <-res; r.err != nil || r.secret != "s3cr3t" || r.body != "hi" {
		t.Errorf("response %+v", r)
	}
}

// TestH2GoAway: streams above the GOAWAY's last stream fail as
// unprocessed (safe to resend elsewhere); the one below completes; the
// connection takes no more.
func TestH2GoAway(t *testing.T) {
	cc, p := newPeer(t, nil)
	errs := make(chan error, 2)
	for range 2 {
		go func() {
			resp, err := cc.RoundTrip(newRequest(t, ctxTimeout(t, 10*time.Second), "GET", "https://peer.test/", nil))
			if err == nil {
				_, err = io.ReadAll(resp.Body)
				resp.Body.Close()
			}
			errs <- err
		}()
	}
	first := p.next(http2.FrameHeaders).(*http2.MetaHeadersFrame)
	p.next(http2.FrameHeaders)
	p.fr.WriteGoAway(first.StreamID, http2.ErrCodeNo, nil)
	p.respond(first.StreamID, true, ":status", "204")
	var ok, unprocessed int
	for range 2 {
		switch err := <-errs; {
		case err == nil:
			ok++
		case errors.Is(err, ErrUnprocessed):
			unprocessed++
		default:
			t.Errorf("unexpected error %v", err)
		}
	}
	if ok != 1 || unprocessed != 1 || cc.CanTakeRequest() {
		t.Errorf("%d completed, %d unprocessed, can take more: %v", ok, unprocessed, cc.CanTakeRequest())
	}
}

// TestH2PeerMisbehaves: a stream the peer overruns is reset with
// FLOW_CONTROL_ERROR, a refused stream is unprocessed, a PING is
// answered, and the connection goes on.
func TestH2PeerMisbehaves(t *testing.T) {
	pre := &fingerprint.H2{Settings: []fingerprint.Setting{{ID: 4, Val: 1000}}, WindowUpdate: 1 << 20}
	cc, p := newPeer(t, pre)
	ctx := ctxTimeout(t, 10*time.Second)

	res := make(chan error, 1)
	go func() {
		resp, err := cc.RoundTrip(newRequest(t, ctx, "GET", "https://peer.test/a", nil))
		if err == nil {
			_, err = io.ReadAll(resp.Body)
		}
		res <- err
	}()
	h := p.next(http2.FrameHeaders)
	p.respond(h.Header().StreamID, false, ":status", "200")
	p.fr.WriteData(h.Header().StreamID, false, make([]byte, 2000)) // the window is 1000
	rst := p.next(http2.FrameRSTStream).(*http2.RSTStreamFrame)
	if rst.ErrCode != http2.ErrCodeFlowControl {
		t.Errorf("RST_STREAM %v, want FLOW_CONTROL_ERROR", rst.ErrCode)
	}
	if err := <-res; err == nil {
		t.Error("an overrun stream read cleanly")
	}

	go func() {
		_, err := cc.RoundTrip(newRequest(t, ctx, "GET", "https://peer.test/b", nil))
		res <- err
	}()
	h = p.next(http2.FrameHeaders)
	p.fr.WriteRSTStream(h.Header().StreamID, http2.ErrCodeRefusedStream)
	if err := <-res; !errors.Is(err, ErrUnprocessed) {
		t.Errorf("refused stream: %v", err)
	}

	p.fr.WritePing(false, [8]byte{1, 2, 3, 4, 5, 6, 7, 8})
	ping := p.next(http2.FramePing).(*http2.PingFrame)
	if !ping.IsAck() || ping.Data != [8]byte{1, 2, 3, 4, 5, 6, 7, 8} {
		t.Errorf("ping answer %+v", ping)
	}
	if !cc.CanTakeRequest() {
		t.Error("the connection did not survive")
	}
}
