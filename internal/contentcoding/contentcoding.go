// Package contentcoding decodes HTTP content codings (gzip, deflate, br,
// zstd) of bodies the proxy holds in memory: the dedup engine decodes a
// stored body for a client that does not accept its coding, the upstream
// pool looks for ban text in a compressed body. Output is always bounded by
// the caller: a small compressed body can expand without limit.
package contentcoding

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"errors"
	"io"
	"strings"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/zstd"
)

// ErrUnknown is returned for a coding this package cannot decode.
var ErrUnknown = errors.New("unknown content coding")

// maxWindow bounds zstd's decoder memory (its window), independent of the
// caller's output limit.
const maxWindow = 64 << 20

// NewReader returns a reader of b decoded from coding ("gzip", "x-gzip",
// "deflate", "br", "zstd"; case and spaces ignored) and a function that
// releases the decoder. "" and "identity" read b as it is.
func NewReader(coding string, b []byte) (io.Reader, func(), error) {
	noop := func() {}
	switch strings.ToLower(strings.TrimSpace(coding)) {
	case "", "identity":
		return bytes.NewReader(b), noop, nil
	case "gzip", "x-gzip":
		zr, err := gzip.NewReader(bytes.NewReader(b))
		if err != nil {
			return nil, noop, err
		}
		return zr, noop, nil
	case "deflate":
		// "deflate" is zlib-wrapped by the spec and raw DEFLATE in
		// practice as often as not; the zlib header check tells them apart.
		if zr, err := zlib.NewReader(bytes.NewReader(b)); err == nil {
			return zr, noop, nil
		}
		return flate.NewReader(bytes.NewReader(b)), noop, nil
	case "br":
		return brotli.NewReader(bytes.NewReader(b)), noop, nil
	case "zstd":
		zr, err := zstd.NewReader(bytes.NewReader(b), zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxMemory(maxWindow))
		if err != nil {
			return nil, noop, err
		}
		return zr, zr.Close, nil
	}
	return nil, noop, ErrUnknown
}
