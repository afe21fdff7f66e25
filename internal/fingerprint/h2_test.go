package fingerprint

import (
	"bytes"
	"reflect"
	"testing"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// clientBytes writes an HTTP/2 client's side of a connection with x/net's
// Framer, as a real client would.
type clientBytes struct {
	buf  bytes.Buffer
	fr   *http2.Framer
	enc  *hpack.Encoder
	hbuf bytes.Buffer
}

func newClientBytes() *clientBytes {
	c := &clientBytes{}
	c.buf.WriteString(ClientPreface)
	c.fr = http2.NewFramer(&c.buf, nil)
	c.enc = hpack.NewEncoder(&c.hbuf)
	return c
}

// headers writes one header block, split into CONTINUATIONs of at most
// chunk bytes when chunk > 0.
func (c *clientBytes) headers(t testing.TB, stream uint32, prio *http2.PriorityParam, endStream bool, chunk int, fields ...string) {
	t.Helper()
	c.hbuf.Reset()
	for i := 0; i < len(fields); i += 2 {
		if err := c.enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]}); err != nil {
			t.Fatal(err)
		}
	}
	block := c.hbuf.Bytes()
	first := block
	if chunk > 0 && len(block) > chunk {
		first = block[:chunk]
	}
	p := http2.HeadersFrameParam{StreamID: stream, BlockFragment: first, EndStream: endStream, EndHeaders: len(first) == len(block)}
	if prio != nil {
		p.Priority = *prio
	}
	if err := c.fr.WriteHeaders(p); err != nil {
		t.Fatal(err)
	}
	for rest := block[len(first):]; len(rest) > 0; {
		k := min(chunk, len(rest))
		if err := c.fr.WriteContinuation(stream, k == len(rest), rest[:k]); err != nil {
			t.Fatal(err)
		}
		rest = rest[k:]
	}
}

var chromeSettings = []http2.Setting{
	{ID: 1, Val: 65536}, {ID: 2, Val: 0}, {ID: 4, Val: 6291456}, {ID: 6, Val: 262144},
}

// chromeConn is what Chrome sends on a fresh connection: SETTINGS, the
// connection WINDOW_UPDATE, a document request with an exclusive priority,
// then a second request and some noise a server ignores.
func chromeConn(t testing.TB) []byte {
	c := newClientBytes()
	if err := c.fr.WriteSettings(chromeSettings...); err != nil {
		t.Fatal(err)
	}
	if err := c.fr.WriteWindowUpdate(0, 15663105); err != nil {
		t.Fatal(err)
	}
	c.headers(t, 1, &http2.PriorityParam{Exclusive: true, Weight: 255}, true, 0,
		":method", "GET", ":authority", "origin.test", ":scheme", "https", ":path", "/",
		"sec-ch-ua", `"Chromium";v="156"`, "user-agent", "Mozilla/5.0", "accept", "text/html",
		"cookie", "a=1", "cookie", "b=2")
	if err := c.fr.WriteSettingsAck(); err != nil {
		t.Fatal(err)
	}
	if err := c.fr.WriteWindowUpdate(0, 1000); err != nil { // not the first: ignored
		t.Fatal(err)
	}
	c.headers(t, 3, &http2.PriorityParam{Exclusive: true, StreamDep: 1, Weight: 219}, false, 7,
		":method", "POST", ":authority", "origin.test", ":scheme", "https", ":path", "/form",
		"content-type", "application/x-www-form-urlencoded", "user-agent", "Mozilla/5.0")
	if err := c.fr.WriteData(3, false, bytes.Repeat([]byte("x"), 3000)); err != nil {
		t.Fatal(err)
	}
	c.headers(t, 3, nil, true, 0, "x-trailer", "1") // trailers: not a request
	if err := c.fr.WritePing(false, [8]byte{}); err != nil {
		t.Fatal(err)
	}
	return c.buf.Bytes()
}

func TestH2DecoderChrome(t *testing.T) {
	b := chromeConn(t)
	pre, first, err := ParseH2Preface(b)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := pre.Akamai(), "1:65536;2:0;4:6291456;6:262144|15663105|0|m,a,s,p"; got != want {
		t.Errorf("Akamai = %s, want %s", got, want)
	}
	if pre.HeaderPriority == nil || *pre.HeaderPriority != (Priority{Exclusive: true, Weight: 255}) || pre.FirstStreamID != 1 {
		t.Errorf("header priority %+v, first stream %d", pre.HeaderPriority, pre.FirstStreamID)
	}
	if first.Method != "GET" || first.Authority != "origin.test" || first.Path != "/" {
		t.Errorf("first request %+v", first)
	}
	if got, want := first.Shape.HeaderOrder, []string{"sec-ch-ua", "user-agent", "accept", "cookie", "cookie"}; !reflect.DeepEqual(got, want) {
		t.Errorf("header order %q, want %q", got, want)
	}

	// Every request of the connection, whatever the Write boundaries.
	for _, step := range []int{1, 2, 9, 10, 4096, len(b)} {
		d := NewH2Decoder(4096)
		var reqs []H2Request
		for i := 0; i < len(b); i += step {
			if _, err := d.Write(b[i:min(i+step, len(b))]); err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			reqs = append(reqs, d.Requests()...)
		}
		if len(reqs) != 2 || reqs[1].Method != "POST" || reqs[1].Path != "/form" || reqs[1].StreamID != 3 {
			t.Fatalf("step %d: requests %+v", step, reqs)
		}
		if got, want := reqs[1].Shape.HeaderOrder, []string{"content-type", "user-agent"}; !reflect.DeepEqual(got, want) {
			t.Errorf("step %d: second request order %q", step, got)
		}
		if p := reqs[1].Shape.Priority; p == nil || *p != (Priority{Exclusive: true, StreamDep: 1, Weight: 219}) {
			t.Errorf("step %d: second request priority %+v", step, p)
		}
		if got := d.Preface().Akamai(); got != pre.Akamai() {
			t.Errorf("step %d: Akamai %s", step, got)
		}
	}
}

func TestH2DecoderPriorityFrames(t *testing.T) {
	// Firefox before version 90 built a priority tree out of idle streams
	// and sent its first request on stream 15.
	c := newClientBytes()
	if err := c.fr.WriteSettings(http2.Setting{ID: 1, Val: 65536}, http2.Setting{ID: 4, Val: 131072}, http2.Setting{ID: 5, Val: 16384}); err != nil {
		t.Fatal(err)
	}
	if err := c.fr.WriteWindowUpdate(0, 12517377); err != nil {
		t.Fatal(err)
	}
	for _, p := range []struct {
		id, dep uint32
		w       uint8
	}{{3, 0, 200}, {5, 0, 100}, {7, 0, 0}, {9, 7, 0}, {11, 3, 0}, {13, 0, 240}} {
		if err := c.fr.WritePriority(p.id, http2.PriorityParam{StreamDep: p.dep, Weight: p.w}); err != nil {
			t.Fatal(err)
		}
	}
	c.headers(t, 15, &http2.PriorityParam{StreamDep: 13, Weight: 41}, true, 0,
		":method", "GET", ":path", "/", ":authority", "origin.test", ":scheme", "https")
	pre, _, err := ParseH2Preface(c.buf.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	if got, want := pre.Akamai(), "1:65536;4:131072;5:16384|12517377|3:0:0:201,5:0:0:101,7:0:0:1,9:0:7:1,11:0:3:1,13:0:0:241|m,p,a,s"; got != want {
		t.Errorf("Akamai = %s\nwant %s", got, want)
	}
	if pre.FirstStreamID != 15 {
		t.Errorf("first stream %d", pre.FirstStreamID)
	}
}

func TestH2DecoderRejects(t *testing.T) {
	good := chromeConn(t)
	for name, b := range map[string][]byte{
		"http/1.1":         []byte("GET / HTTP/1.1\r\n"),
		"bad preface":      []byte("PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n"),
		"settings ragged":  append([]byte(ClientPreface), 0, 0, 5, 4, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5),
		"interrupted":      interruptedBlock(t),
		"huge frame":       append([]byte(ClientPreface), 0xff, 0xff, 0xff, 1, 0, 0, 0, 0, 1),
		"bad hpack":        append([]byte(ClientPreface), 0, 0, 1, 1, 4, 0, 0, 0, 1, 0xff),
		"preface only ok?": good[:len(ClientPreface)],
	} {
		d := NewH2Decoder(4096)
		_, err := d.Write(b)
		if name == "preface only ok?" {
			if err != nil || d.Preface() != nil {
				t.Errorf("%s: %v, %v", name, err, d.Preface())
			}
			continue
		}
		if err == nil {
			t.Errorf("%s: no error", name)
		}
		if _, err2 := d.Write(good); err2 != err {
			t.Errorf("%s: a dead decoder returned %v, then %v", name, err, err2)
		}
	}
}

// interruptedBlock is a HEADERS without END_HEADERS followed by a PING.
func interruptedBlock(t *testing.T) []byte {
	c := newClientBytes()
	if err := c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte{0x82}}); err != nil {
		t.Fatal(err)
	}
	if err := c.fr.WritePing(false, [8]byte{}); err != nil {
		t.Fatal(err)
	}
	return c.buf.Bytes()
}
