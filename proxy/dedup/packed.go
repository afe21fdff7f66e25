package dedup

import (
	"encoding/binary"
	"net/http"
	"slices"
	"time"
	"unsafe"
)

// packed is an Entry as the memory store keeps it: its key, URL key, Vary
// values, header fields and body in one byte slice, which the garbage
// collector marks without looking inside. The store's key string points
// into that slice too.
//
// Why: an entry as net/http built it is some sixteen objects (the header
// map, a slice and a string or two per field, the key strings), and the
// collector walks all of them in every cycle. A cache full of small pages
// (256 MiB of 2 KiB ones is about 100,000 entries, 1.6 million objects)
// made marking a quarter of the process's CPU at steady state (pprof of
// onceload's unique misses once the cache was full); packed, an entry is
// otter's node (which holds this struct) and one slice. A hit
// pays for it with an unpack: the header map and one slice of values (the
// strings point into the slice, no copies).
type packed struct {
	data      []byte
	fields    int32 // header field names in data
	values    int32 // header values in data
	vary      int32 // Vary name/value pairs in data
	body      int32 // where the body starts in data
	status    int32
	storedAt  int64 // Unix nanoseconds
	expiresAt int64
}

// packedOverhead estimates what an entry costs the memory store beyond
// its data: otter's node, with the packed struct in it.
const packedOverhead = 160

// pack copies e, stored under key, into its packed form.
func pack(key string, e *Entry) packed {
	p, body := packHead(key, e, len(e.Body))
	copy(body, e.Body)
	return p
}

// packHead packs everything of e, stored under key, but its body, and
// leaves room for a body of size bytes, returned for the caller to fill: a
// flight reads a small body straight into the form the memory store keeps
// (see Entry.packed).
func packHead(key string, e *Entry, size int) (p packed, body []byte) {
	n := len(key) + len(e.URLKey) + size + 2*binary.MaxVarintLen32
	for _, v := range e.Vary {
		n += len(v.Name) + len(v.Value) + 2*binary.MaxVarintLen32
	}
	values := 0
	for k, vs := range e.Header {
		n += len(k) + 2*binary.MaxVarintLen32
		for _, v := range vs {
			n += len(v) + binary.MaxVarintLen32
		}
		values += len(vs)
	}
	// Grown, not made: the capacity is then what the runtime allocated
	// (its size class), which size counts.
	b := slices.Grow([]byte(nil), n)
	b = appendPackedString(b, key)
	b = appendPackedString(b, e.URLKey)
	for _, v := range e.Vary {
		b = appendPackedString(b, v.Name)
		b = appendPackedString(b, v.Value)
	}
	for k, vs := range e.Header {
		b = appendPackedString(b, k)
		b = binary.AppendUvarint(b, uint64(len(vs)))
		for _, v := range vs {
			b = appendPackedString(b, v)
		}
	}
	p = packed{
		fields: int32(len(e.Header)), values: int32(values), vary: int32(len(e.Vary)), body: int32(len(b)),
		status: int32(e.Status), storedAt: nanos(e.StoredAt), expiresAt: nanos(e.ExpiresAt),
	}
	p.data = b[:len(b)+size]
	return p, p.bodyBytes()
}

// bodyBytes is the body in p.data, capped so that an append copies.
func (p *packed) bodyBytes() []byte { return p.data[p.body:len(p.data):len(p.data)] }

// nanos is t in Unix nanoseconds, 0 for the zero time (fromNanos's
// inverse).
func nanos(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func fromNanos(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

func appendPackedString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// size is the packed entry's weight in the memory store: what it holds in
// memory (the capacity of data is its allocation).
func (p *packed) size() int64 { return int64(cap(p.data)) + packedOverhead }

// expired reports whether the entry's time is up at now.
func (p *packed) expired(now time.Time) bool {
	return p.expiresAt != 0 && now.UnixNano() >= p.expiresAt
}

// entry unpacks p. The strings and the body point into p.data, which
// nothing writes to once packed (an Entry is immutable).
func (p *packed) entry() *Entry {
	r := packedReader{b: p.data}
	r.str() // the key
	e := &Entry{
		Status:    int(p.status),
		StoredAt:  fromNanos(p.storedAt),
		ExpiresAt: fromNanos(p.expiresAt),
		URLKey:    r.str(),
		Body:      p.bodyBytes(),
		packed:    *p,
		private:   true,
	}
	if p.vary > 0 {
		e.Vary = make([]HeaderValue, p.vary)
		for i := range e.Vary {
			e.Vary[i] = HeaderValue{Name: r.str(), Value: r.str()}
		}
	}
	// Room for the fields every answer adds (see shareHeader).
	e.Header = make(http.Header, p.fields+3)
	values := make([]string, p.values)
	for range p.fields {
		k := r.str()
		n := int(r.uvarint())
		vs := values[:n:n]
		values = values[n:]
		for i := range vs {
			vs[i] = r.str()
		}
		e.Header[k] = vs
	}
	return e
}

// key is the key p was packed for, in p.data.
func (p *packed) key() string {
	r := packedReader{b: p.data}
	return r.str()
}

// urlKeyIs reports whether p's URL key is k, without unpacking.
func (p *packed) urlKeyIs(k string) bool {
	r := packedReader{b: p.data}
	r.str() // the key
	return r.str() == k
}

// packedReader reads what pack wrote; it trusts it, as nothing else writes
// there.
type packedReader struct {
	b   []byte
	off int
}

func (r *packedReader) uvarint() uint64 {
	v, n := binary.Uvarint(r.b[r.off:])
	r.off += n
	return v
}

func (r *packedReader) str() string {
	n := int(r.uvarint())
	if n == 0 {
		return ""
	}
	s := unsafe.String(&r.b[r.off], n)
	r.off += n
	return s
}
