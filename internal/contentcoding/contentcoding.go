// Package contentcoding decodes HTTP content codings (gzip, deflate, br,
// zstd), of bodies held in memory or read as they stream: the dedup engine
// decodes a stored or streaming body for a client that does not accept its
// coding, the upstream pool looks for ban text in a compressed body. Output is always bounded by
// the caller: a small compressed body can expand without limit.
package contentcoding

import (
	"bufio"
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
// caller's output limit. The decoder allocates the window a frame header
// declares before it decodes a byte, so a 14-byte body could cost that
// much heap per decoding client. RFC 9659 caps the window of the zstd
// content coding at 8 MB (encoders must not exceed it, browsers refuse
// more), and zstd's encoders stay within it by default.
const maxWindow = 8 << 20

// NewReader returns a reader of b decoded from coding ("gzip", "x-gzip",
// "deflate", "br", "zstd"; case and spaces ignored) and a function that
// releases the decoder. "" and "identity" read b as it is.
func NewReader(coding string, b []byte) (io.Reader, func(), error) {
	return NewStreamReader(coding, bytes.NewReader(b))
}

// Known reports whether NewStreamReader can decode coding, without reading
// anything: a caller that must not block (the body has not arrived yet)
// decides with it and creates the decoder on first use.
func Known(coding string) bool {
	switch strings.ToLower(strings.TrimSpace(coding)) {
	case "", "identity", "gzip", "x-gzip", "deflate", "br", "zstd":
		return true
	}
	return false
}

// NewStreamReader is NewReader over a stream: the decoder reads r as it
// needs (gzip and zlib read their header at once, so this blocks until r
// yields it).
func NewStreamReader(coding string, r io.Reader) (io.Reader, func(), error) {
	noop := func() {}
	switch strings.ToLower(strings.TrimSpace(coding)) {
	case "", "identity":
		return r, noop, nil
	case "gzip", "x-gzip":
		zr, err := gzip.NewReader(r)
		if err != nil {
			return nil, noop, err
		}
		return zr, noop, nil
	case "deflate":
		// "deflate" is zlib-wrapped by the spec and raw DEFLATE in
		// practice as often as not; the zlib header check tells them apart.
		br := bufio.NewReader(r)
		if hdr, err := br.Peek(2); err == nil && isZlibHeader(hdr) {
			zr, err := zlib.NewReader(br)
			if err != nil {
				return nil, noop, err
			}
			return zr, noop, nil
		}
		return flate.NewReader(br), noop, nil
	case "br":
		return brotli.NewReader(r), noop, nil
	case "zstd":
		zr, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxMemory(maxWindow))
		if err != nil {
			return nil, noop, err
		}
		return zr, zr.Close, nil
	}
	return nil, noop, ErrUnknown
}

// isZlibHeader checks RFC 1950's two header bytes: method 8 (deflate), a
// window of at most 32 KiB, and the check bits.
func isZlibHeader(h []byte) bool {
	return h[0]&0x0f == 8 && h[0]>>4 <= 7 && (uint16(h[0])<<8|uint16(h[1]))%31 == 0
}
