// Package storecodec is the binary format of what fleet stores keep for
// onceproxy: a cached response (a Redis value, a PostgreSQL bytea) and a
// flight's outcome. Every store uses the same versioned format, so a value
// is read the same way whichever store it came from, and a value of
// another version is ignored, never misread.
//
// Everything a store hands back is untrusted input: Decode checks every
// length against what is left, and returns ErrFormat for anything it did
// not write.
package storecodec

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/klauspost/compress/s2"
	"github.com/klauspost/compress/zstd"
	"golang.org/x/net/http/httpguts"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// The stored value is one compact binary string per response:
//
//	"ONCE" | version byte | flags byte | fields...
//
// A value of another version is ignored (a miss), never misread: rolling
// upgrades across the fleet just refetch.
const (
	magic = "ONCE"
	// Version is the format version this package writes and reads.
	Version = 1

	flagZstd = 1 << 0 // body is zstd-compressed (written by older versions; still read)
	flagS2   = 1 << 1 // body is an S2 block

	// compressMin is the smallest body worth compressing.
	compressMin = 1024
)

// ErrFormat marks a value this version did not write: another format
// version, truncated or corrupt bytes.
var ErrFormat = errors.New("storecodec: value in an unknown format")

var (
	zdec     *zstd.Decoder
	zstdOnce sync.Once
)

// zbufs are Encode's compression buffers; one that grew past maxPooledZ
// is left to the collector, so the pool holds small ones only.
var zbufs = sync.Pool{New: func() any { b := make([]byte, 4<<10); return &b }}

const maxPooledZ = 256 << 10

func zstdDecoder() *zstd.Decoder {
	zstdOnce.Do(func() {
		// DecodeAll is safe for concurrent use on one decoder.
		zdec, _ = zstd.NewReader(nil, zstd.WithDecoderConcurrency(0), zstd.WithDecoderMaxMemory(1<<30))
	})
	return zdec
}

// Encode serializes e. Bodies that are worth it (text-like, not already
// content-encoded, at least 1 KiB) are compressed: Redis memory and the
// network between proxy and store are shared by the whole fleet.
//
// The codec is S2 (Snappy's successor), not zstd as before: measured on
// HTML here, S2 compresses 3.5 times as fast (a 100 KiB page: 0.19 ms
// against 0.70 ms of the miss's CPU, more than the rest of the miss path)
// and decompresses faster still, for values about a third bigger (0.45 of
// the page against 0.33).
func Encode(e *dedup.Entry) []byte { return AppendEncode(nil, e) }

// AppendEncode is Encode appending to dst (which it grows once, to the
// value's size): a store that writes values from buffers of its own
// reuses them.
func AppendEncode(dst []byte, e *dedup.Entry) []byte {
	body, flags := e.Body, byte(0)
	if len(body) >= compressMin && compressible(e.Header) {
		// Compressed into a pooled buffer: the value below copies it
		// anyway, and a miss should not allocate its body twice.
		zp := zbufs.Get().(*[]byte)
		defer func() {
			if cap(*zp) <= maxPooledZ {
				zbufs.Put(zp)
			}
		}()
		if n := s2.MaxEncodedLen(len(body)); n > len(*zp) {
			*zp = make([]byte, n)
		}
		if z := s2.Encode(*zp, body); len(z) < len(body)*9/10 {
			body, flags = z, flagS2
		}
	}
	b := slices.Grow(dst, 64+len(body)+len(e.URLKey)+headerSize(e.Header))
	b = append(b, magic...)
	b = append(b, Version, flags)
	b = binary.AppendUvarint(b, uint64(e.Status))
	b = binary.AppendVarint(b, e.StoredAt.UnixMilli())
	b = binary.AppendVarint(b, e.ExpiresAt.UnixMilli())
	b = appendString(b, e.URLKey)
	b = binary.AppendUvarint(b, uint64(len(e.Header)))
	for k, vs := range e.Header {
		b = appendString(b, k)
		b = binary.AppendUvarint(b, uint64(len(vs)))
		for _, v := range vs {
			b = appendString(b, v)
		}
	}
	b = binary.AppendUvarint(b, uint64(len(e.Vary)))
	for _, v := range e.Vary {
		b = appendString(b, v.Name)
		b = appendString(b, v.Value)
	}
	b = binary.AppendUvarint(b, uint64(len(body)))
	return append(b, body...)
}

func headerSize(h http.Header) int {
	n := 0
	for k, vs := range h {
		n += len(k) + 4
		for _, v := range vs {
			n += len(v) + 2
		}
	}
	return n
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// compressible reports a text-like, not content-encoded body.
func compressible(h http.Header) bool {
	if ce := h.Get("Content-Encoding"); ce != "" && !strings.EqualFold(ce, "identity") {
		return false
	}
	// The media type alone, as mime.ParseMediaType would return it, without
	// the map of parameters it builds: this runs for every value stored.
	mt, _, _ := strings.Cut(h.Get("Content-Type"), ";")
	mt = strings.ToLower(strings.TrimSpace(mt))
	switch {
	case strings.HasPrefix(mt, "text/"),
		strings.HasSuffix(mt, "+json"), strings.HasSuffix(mt, "+xml"),
		mt == "application/json", mt == "application/xml", mt == "application/javascript",
		mt == "application/x-www-form-urlencoded", mt == "image/svg+xml":
		return true
	}
	return false
}

// Decode parses a value written by Encode. Anything else — another format
// version, truncated or corrupt bytes, a header no HTTP message can carry —
// is ErrFormat.
func Decode(b []byte) (*dedup.Entry, error) { return DecodeLimit(b, maxBodyDefault) }

// BodyLimit is the bound to decode a store's values with when each is at
// most maxValue bytes: real responses compress far less than 64 to 1, so a
// body that claims more was not written by onceproxy.
func BodyLimit(maxValue int64) int64 { return 64 * maxValue }

// Shareable reports whether e, encoded as value, belongs in a store whose
// values are at most maxValue bytes: value within maxValue, and a body its
// readers decode (BodyLimit). A body that compresses better than that
// bound fits the first test and fails every read: stored, every instance
// would drop it and fetch again.
func Shareable(e *dedup.Entry, value []byte, maxValue int64) bool {
	return int64(len(value)) <= maxValue && int64(len(e.Body)) <= BodyLimit(maxValue)
}

// maxBodyDefault bounds a decompressed body when the caller names no bound.
const maxBodyDefault = 1 << 30

// DecodeLimit is Decode for bodies of at most maxBody bytes once
// decompressed: a small corrupt or hostile value must not make the reader
// allocate gigabytes.
func DecodeLimit(b []byte, maxBody int64) (*dedup.Entry, error) {
	if len(b) < len(magic)+2 || string(b[:len(magic)]) != magic || b[len(magic)] != Version {
		return nil, ErrFormat
	}
	flags := b[len(magic)+1]
	if flags&^(flagZstd|flagS2) != 0 || flags == flagZstd|flagS2 {
		return nil, ErrFormat
	}
	r := reader{b: b[len(magic)+2:]}
	e := &dedup.Entry{}
	e.Status = int(r.uvarint())
	e.StoredAt = time.UnixMilli(r.varint())
	e.ExpiresAt = time.UnixMilli(r.varint())
	e.URLKey = r.str()
	// Counts size nothing ahead beyond maxPrealloc, and every loop stops
	// at the first unreadable field: a count is only a claim, and one that
	// lies must cost what the value holds, not what it claims.
	n := r.count()
	e.Header = make(http.Header, min(n, maxPrealloc))
	for i := 0; i < n && r.err == nil; i++ {
		k := r.str()
		vn := r.count()
		vs := make([]string, 0, min(vn, maxPrealloc))
		for j := 0; j < vn && r.err == nil; j++ {
			v := r.str()
			if !httpguts.ValidHeaderFieldValue(v) {
				r.fail()
			}
			vs = append(vs, v)
		}
		// Names as net/http reads them: a name kept in another case is
		// invisible to Header.Get (Content-Length, Transfer-Encoding) yet
		// written to clients as it is, beside the field net/http adds.
		// Two names that differ in case are one field twice.
		ck := http.CanonicalHeaderKey(k)
		if _, dup := e.Header[ck]; dup || !httpguts.ValidHeaderFieldName(k) {
			r.fail()
		}
		e.Header[ck] = vs
	}
	if n := r.count(); n > 0 {
		e.Vary = make([]dedup.HeaderValue, 0, min(n, maxPrealloc))
		for i := 0; i < n && r.err == nil; i++ {
			e.Vary = append(e.Vary, dedup.HeaderValue{Name: r.str(), Value: r.str()})
		}
	}
	body := r.bytes()
	if r.err != nil || len(r.b) != 0 || e.Status < 100 || e.Status > 999 {
		return nil, ErrFormat
	}
	switch {
	case flags&flagS2 != 0:
		plain, err := inflateS2(body, maxBody)
		if err != nil {
			return nil, err
		}
		body = plain
	case flags&flagZstd != 0:
		plain, err := decompress(body, maxBody)
		if err != nil {
			return nil, err
		}
		body = plain
	case int64(len(body)) > maxBody:
		return nil, ErrFormat
	}
	e.Body = body
	return e, nil
}

// inflateS2 inflates an S2 block Encode wrote, which declares its size:
// at most maxBody.
func inflateS2(z []byte, maxBody int64) ([]byte, error) {
	n, err := s2.DecodedLen(z)
	if err != nil || int64(n) > maxBody {
		return nil, fmt.Errorf("%w: compressed body without a size within %d bytes", ErrFormat, maxBody)
	}
	plain, err := s2.Decode(make([]byte, n), z)
	if err != nil || len(plain) != n {
		return nil, fmt.Errorf("%w: compressed body does not inflate to its size: %v", ErrFormat, err)
	}
	return plain, nil
}

// decompress inflates a zstd body an older version wrote: one frame that
// declares its size, at most maxBody.
func decompress(z []byte, maxBody int64) ([]byte, error) {
	var h zstd.Header
	if err := h.Decode(z); err != nil || !h.HasFCS || h.FrameContentSize > uint64(maxBody) {
		return nil, fmt.Errorf("%w: compressed body without a size within %d bytes", ErrFormat, maxBody)
	}
	plain, err := zstdDecoder().DecodeAll(z, make([]byte, 0, h.FrameContentSize))
	if err != nil || uint64(len(plain)) != h.FrameContentSize {
		return nil, fmt.Errorf("%w: compressed body does not inflate to its size: %v", ErrFormat, err)
	}
	return plain, nil
}

// maxPrealloc is the most entries a count read from a value sizes a map or
// slice for before they are read: a count may claim one entry per byte
// left, and a header map sized for a million claimed names is about 96
// MiB, for a 1 MiB value. Real responses have a few dozen fields.
const maxPrealloc = 64

// reader consumes the length-prefixed fields of a value; the first error
// sticks and every later read returns zero values.
type reader struct {
	b   []byte
	err error
}

func (r *reader) uvarint() uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.err = ErrFormat
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) varint() int64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Varint(r.b)
	if n <= 0 {
		r.err = ErrFormat
		return 0
	}
	r.b = r.b[n:]
	return v
}

// count reads a collection length, refusing lengths the remaining bytes
// cannot possibly hold (a corrupt value must not allocate gigabytes).
func (r *reader) count() int {
	n := r.uvarint()
	if n > uint64(len(r.b)) {
		r.err = ErrFormat
		return 0
	}
	return int(n)
}

func (r *reader) bytes() []byte {
	n := r.count()
	if r.err != nil {
		return nil
	}
	v := r.b[:n:n]
	r.b = r.b[n:]
	return v
}

func (r *reader) str() string { return string(r.bytes()) }

// fail marks the value unreadable; every later read returns zero values.
func (r *reader) fail() {
	if r.err == nil {
		r.err = ErrFormat
	}
}
