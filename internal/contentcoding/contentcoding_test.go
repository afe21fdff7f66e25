package contentcoding

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"errors"
	"io"
	"testing"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/zstd"
)

func TestRoundTrip(t *testing.T) {
	plain := bytes.Repeat([]byte("decode me "), 500)
	enc := func(w io.WriteCloser, buf *bytes.Buffer) []byte { w.Write(plain); w.Close(); return buf.Bytes() }
	var g, z, f, br bytes.Buffer
	zs, _ := zstd.NewWriter(nil)
	fw, _ := flate.NewWriter(&f, flate.BestSpeed)
	for coding, body := range map[string][]byte{
		"gzip":     enc(gzip.NewWriter(&g), &g),
		"deflate":  enc(zlib.NewWriter(&z), &z),
		" Deflate": enc(fw, &f), // raw DEFLATE under the same name
		"br":       enc(brotli.NewWriter(&br), &br),
		"zstd":     zs.EncodeAll(plain, nil),
		"identity": plain,
	} {
		r, done, err := NewReader(coding, body)
		if err != nil {
			t.Fatalf("%s: %v", coding, err)
		}
		out, err := io.ReadAll(r)
		done()
		if err != nil || !bytes.Equal(out, plain) {
			t.Errorf("%s: %d bytes, %v", coding, len(out), err)
		}
	}
	if _, _, err := NewReader("compress", nil); !errors.Is(err, ErrUnknown) {
		t.Errorf("unknown coding: %v", err)
	}
	if _, _, err := NewReader("gzip", []byte("not gzip")); err == nil {
		t.Error("corrupt gzip accepted")
	}
}

// TestStreamReaderMatchesNewReader: the streaming decoder reads what the
// buffered one does, fed one byte at a time, for both flavours of deflate.
func TestStreamReaderMatchesNewReader(t *testing.T) {
	plain := bytes.Repeat([]byte("stream me "), 700)
	var z, f bytes.Buffer
	zw := zlib.NewWriter(&z)
	zw.Write(plain)
	zw.Close()
	fw, _ := flate.NewWriter(&f, flate.BestSpeed)
	fw.Write(plain)
	fw.Close()
	for name, body := range map[string][]byte{"zlib": z.Bytes(), "raw": f.Bytes()} {
		r, done, err := NewStreamReader("deflate", iotestOneByte{bytes.NewReader(body)})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		out, err := io.ReadAll(r)
		done()
		if err != nil || !bytes.Equal(out, plain) {
			t.Errorf("%s: %d bytes, %v", name, len(out), err)
		}
	}
	for _, c := range []string{"gzip", " BR", "zstd", "identity", ""} {
		if !Known(c) {
			t.Errorf("Known(%q) = false", c)
		}
	}
	if Known("compress") {
		t.Error("Known(compress) = true")
	}
}

type iotestOneByte struct{ r io.Reader }

func (o iotestOneByte) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	return o.r.Read(p[:1])
}
