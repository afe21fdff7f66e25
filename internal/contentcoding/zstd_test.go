package contentcoding

import (
	"bytes"
	"io"
	"runtime"
	"testing"
)

// zstdFrame returns a zstd frame of one raw block holding content, whose
// header declares the window descriptor wd (RFC 8878 section 3.1.1.1.2)
// and no content size, so that the decoder sizes its history by the window.
func zstdFrame(wd byte, content string) []byte {
	b := []byte{0x28, 0xb5, 0x2f, 0xfd, 0x00, wd}
	n := len(content)<<3 | 1 // Block_Size, Block_Type raw, Last_Block
	b = append(b, byte(n), byte(n>>8), byte(n>>16))
	return append(b, content...)
}

// TestZstdWindowLimit: a zstd body may not make the decoder allocate more
// than the 8 MB window RFC 9659 allows the zstd content coding. A hostile
// origin's 14-byte response declaring a 64 MB window used to cost 64 MB
// of heap per decoding client (and per ban scan).
func TestZstdWindowLimit(t *testing.T) {
	for _, tt := range []struct {
		name string
		wd   byte
		ok   bool
	}{
		{"8 MB", 0x68, true},    // 2^23: what zstd encoders use by default
		{"9 MB", 0x69, false},   // 2^23 + 2^23/8
		{"64 MB", 0x80, false},  // 2^26
		{"128 MB", 0x88, false}, // 2^27
	} {
		t.Run(tt.name, func(t *testing.T) {
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			r, done, err := NewReader("zstd", zstdFrame(tt.wd, "hello"))
			var out []byte
			if err == nil {
				out, err = io.ReadAll(r)
			}
			done()
			runtime.ReadMemStats(&after)
			if tt.ok && (err != nil || !bytes.Equal(out, []byte("hello"))) {
				t.Errorf("decoded %q, %v; want hello", out, err)
			}
			if !tt.ok && err == nil {
				t.Errorf("decoded %q; want an error for a window over 8 MB", out)
			}
			if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 12<<20 {
				t.Errorf("decoding allocated %d MiB, want at most 12", alloc>>20)
			}
		})
	}
}
