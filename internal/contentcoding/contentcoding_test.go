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
