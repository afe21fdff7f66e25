package fingerprint

import (
	"bytes"
	"reflect"
	"runtime"
	"testing"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// TestH2DecoderHeaderListBomb: a header block of 1-byte references to one
// dynamic table entry decodes to a million fields. The server stops
// collecting fields past its header list limit (and answers 431 without a
// handler); the decoder used to collect them all, some 300 MB of
// allocations for 1 MiB read, and report the request. It must still keep
// its HPACK table in step: the next request decodes.
func TestH2DecoderHeaderListBomb(t *testing.T) {
	c := newClientBytes()
	if err := c.fr.WriteSettings(chromeSettings...); err != nil {
		t.Fatal(err)
	}
	c.hbuf.Reset()
	for _, f := range []hpack.HeaderField{{Name: ":method", Value: "GET"}, {Name: ":path", Value: "/bomb"}, {Name: "x", Value: "y"}} {
		if err := c.enc.WriteField(f); err != nil {
			t.Fatal(err)
		}
	}
	block := bytes.Clone(c.hbuf.Bytes())
	// 0xbe is "indexed field 62": the newest dynamic entry, x: y.
	block = append(block, bytes.Repeat([]byte{0xbe}, maxHeaderBlock-len(block))...)
	if err := c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block[:16384]}); err != nil {
		t.Fatal(err)
	}
	for rest := block[16384:]; len(rest) > 0; {
		k := min(16384, len(rest))
		if err := c.fr.WriteContinuation(1, k == len(rest), rest[:k]); err != nil {
			t.Fatal(err)
		}
		rest = rest[k:]
	}
	c.headers(t, 3, nil, true, 0, ":method", "GET", ":path", "/next", "x", "y")

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	d := NewH2Decoder(4096)
	if _, err := d.Write(c.buf.Bytes()); err != nil {
		t.Fatal(err)
	}
	runtime.ReadMemStats(&after)
	// The input is 1 MiB, and the decoder may hold a frame and a block of
	// that size; 300 MB is what it used to take.
	if n := after.TotalAlloc - before.TotalAlloc; n > 32<<20 {
		t.Errorf("decoding a 1 MiB header block allocated %d MiB", n>>20)
	}
	reqs := d.Requests()
	if len(reqs) != 1 || reqs[0].StreamID != 3 || reqs[0].Path != "/next" || !reflect.DeepEqual(reqs[0].Shape.HeaderOrder, []string{"x"}) {
		for i := range reqs {
			if n := len(reqs[i].Shape.HeaderOrder); n > 4 {
				reqs[i].Shape.HeaderOrder = reqs[i].Shape.HeaderOrder[:4]
			}
		}
		t.Errorf("requests %+v; want only stream 3's", reqs)
	}
	// The over-long request is still the client's first: the preface ends
	// with it, as it did on the wire.
	if p := d.Preface(); p == nil || p.FirstStreamID != 1 || !reflect.DeepEqual(p.PseudoOrder, []string{":method", ":path"}) {
		t.Errorf("preface %+v", p)
	}
}

// TestH2DecoderPriorityFlood: the server accepts any number of PRIORITY
// frames, and the decoder kept every one sent before the first request
// (16 bytes held for each 14 read, then replayed to the origin on every
// mirrored connection). Past a real client's few it gives up.
func TestH2DecoderPriorityFlood(t *testing.T) {
	flood := func(n int) []byte {
		c := newClientBytes()
		if err := c.fr.WriteSettings(chromeSettings...); err != nil {
			t.Fatal(err)
		}
		for i := range n {
			if err := c.fr.WritePriority(uint32(2*i+3), http2.PriorityParam{Weight: 1}); err != nil {
				t.Fatal(err)
			}
		}
		c.headers(t, 1, nil, true, 0, ":method", "GET", ":path", "/")
		return c.buf.Bytes()
	}
	pre, _, err := ParseH2Preface(flood(maxPrefacePriorities))
	if err != nil {
		t.Fatalf("%d PRIORITY frames: %v", maxPrefacePriorities, err)
	}
	if len(pre.Priorities) != maxPrefacePriorities {
		t.Fatalf("%d priorities kept, want %d", len(pre.Priorities), maxPrefacePriorities)
	}
	d := NewH2Decoder(4096)
	if _, err := d.Write(flood(maxPrefacePriorities + 1)); err == nil {
		t.Fatalf("%d PRIORITY frames before the first request: no error, %d kept", maxPrefacePriorities+1, len(d.pre.Priorities))
	}
	if d.Preface() != nil {
		t.Error("a preface from a decoder that gave up")
	}
}
