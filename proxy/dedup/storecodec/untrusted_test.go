package storecodec

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net/http"
	"runtime"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// headOf is the start of a value up to its header count: magic, version,
// no flags, status 200, both times 0, no URL key.
func headOf() []byte {
	b := append([]byte(magic), Version, 0)
	b = binary.AppendUvarint(b, 200)
	b = binary.AppendVarint(b, 0)
	b = binary.AppendVarint(b, 0)
	return binary.AppendUvarint(b, 0)
}

// allocated is how many bytes f allocates on the heap.
func allocated(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// TestLyingCountsDoNotAllocate: a value whose header, value or vary count
// claims as many entries as it has bytes left, whose first entry is then
// unreadable, is ErrFormat at the cost of a few allocations, not of a map
// or slice sized by the claim. It used to cost a 1 MiB value 96 MiB for
// the header map alone, per read, from any instance (or redis-cli) that
// wrote it.
func TestLyingCountsDoNotAllocate(t *testing.T) {
	const size = 1 << 20
	// 0xff bytes: no uvarint ends within ten of them, so the first field
	// after the count is unreadable.
	junk := bytes.Repeat([]byte{0xff}, size+16)
	for name, b := range map[string][]byte{
		"headers": append(binary.AppendUvarint(headOf(), size), junk...),
		"values": append(binary.AppendUvarint(append(binary.AppendUvarint(binary.AppendUvarint(headOf(), 1),
			1), 'A'), size), junk...),
		"vary": append(binary.AppendUvarint(binary.AppendUvarint(headOf(), 0), size), junk...),
	} {
		var err error
		n := allocated(func() { _, err = Decode(b) })
		if !errors.Is(err, ErrFormat) {
			t.Fatalf("%s: err = %v, want ErrFormat", name, err)
		}
		// The value itself is 1 MiB; the decoder may allocate a few KiB
		// of its own, never a multiple of what the count claims.
		if n > 1<<20 {
			t.Errorf("%s: decoding a %d-byte value whose count lies allocated %d bytes", name, len(b), n)
		}
	}
}

// TestHeaderNamesCanonical: a value is decoded into a header whose names
// are canonical, as net/http reads them, and two names that differ only
// in case are two fields with one name: ErrFormat. A lower-case
// "transfer-encoding" kept as it was stored would have been written to
// clients beside the Content-Length net/http adds (Header.Get never finds
// it), and "content-length" beside the real one: two framings of one
// body.
func TestHeaderNamesCanonical(t *testing.T) {
	e := &dedup.Entry{Status: 200, Body: []byte("abc"), Header: http.Header{
		"transfer-encoding": {"chunked"}, "x-lower": {"v"}, "Content-Type": {"text/plain"},
	}}
	got, err := Decode(Encode(e))
	if err != nil {
		t.Fatal(err)
	}
	for k := range got.Header {
		if k != http.CanonicalHeaderKey(k) {
			t.Errorf("decoded header name %q is not canonical", k)
		}
	}
	if got.Header.Get("Transfer-Encoding") != "chunked" || got.Header.Get("X-Lower") != "v" || got.Header.Get("Content-Type") != "text/plain" {
		t.Errorf("decoded header %v", got.Header)
	}
	twice := Encode(&dedup.Entry{Status: 200, Body: []byte("abc"), Header: http.Header{
		"Content-Length": {"3"}, "content-length": {"999"},
	}})
	if _, err := Decode(twice); !errors.Is(err, ErrFormat) {
		t.Errorf("a header with Content-Length twice, in two cases: err = %v, want ErrFormat", err)
	}
}
