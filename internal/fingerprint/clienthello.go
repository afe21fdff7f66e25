package fingerprint

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// TLS constants used by the parser.
const (
	recordTypeHandshake = 22
	typeClientHello     = 1
	recordHeaderLen     = 5
	maxPlaintext        = 1 << 14 // RFC 8446 §5.1: a record's fragment is at most 2^14 bytes

	// MaxHelloLen bounds a ClientHello message. Real hellos are under 2 KiB
	// (a post-quantum key share makes Chrome's about 1.8 KiB); 64 KiB leaves
	// room for anything a TLS stack sends and keeps a hostile client from
	// making the proxy buffer 16 MiB per connection.
	MaxHelloLen = 64 << 10
)

// Extension IDs the parser decodes.
const (
	ExtServerName          = 0x0000
	ExtSupportedGroups     = 0x000a
	ExtPointFormats        = 0x000b
	ExtSignatureAlgorithms = 0x000d
	ExtALPN                = 0x0010
	ExtPadding             = 0x0015
	ExtSessionTicket       = 0x0023
	ExtPreSharedKey        = 0x0029
	ExtEarlyData           = 0x002a
	ExtSupportedVersions   = 0x002b
	ExtKeyShare            = 0x0033
	ExtECH                 = 0xfe0d
)

// An Extension is one ClientHello extension as on the wire.
type Extension struct {
	Type uint16
	Data []byte
}

// A ClientHello is a parsed TLS ClientHello. The slices alias Raw: treat the
// value as read-only.
type ClientHello struct {
	// Raw is the hello as one TLS record: a 5-byte record header (type 22,
	// the client's record version, the length) followed by the whole
	// handshake message. A hello the client split across records is joined
	// here; this is the form utls' ClientHelloSpec.FromRaw parses.
	Raw []byte

	RecordVersion      uint16 // of the client's first record
	Version            uint16 // legacy_version
	Random             []byte
	SessionID          []byte
	CipherSuites       []uint16
	CompressionMethods []uint8
	// Extensions in wire order. HasExtensions tells an empty extensions
	// block (length 0) from none at all; both occur in old clients.
	Extensions    []Extension
	HasExtensions bool

	// Decoded from the extensions (GREASE values kept as on the wire).
	ServerName          string
	ALPN                []string
	SupportedVersions   []uint16
	SignatureAlgorithms []uint16
	SupportedGroups     []uint16
	PointFormats        []uint8
	KeyShareGroups      []uint16
}

// ErrNotHandshake means the bytes do not start with a TLS handshake record:
// the client speaks something else (plain HTTP, SSLv2's hello, garbage).
var ErrNotHandshake = errors.New("fingerprint: not a TLS handshake record")

// ParseClientHello parses a ClientHello carried in one or more TLS records
// (record headers included), as read from the client. The records must hold
// the hello and nothing else.
func ParseClientHello(records []byte) (*ClientHello, error) {
	msg, recVersion, err := joinRecords(records)
	if err != nil {
		return nil, err
	}
	raw := make([]byte, recordHeaderLen+len(msg))
	raw[0] = recordTypeHandshake
	binary.BigEndian.PutUint16(raw[1:], recVersion)
	// A joined hello over 2^16-1 bytes cannot be described by one record
	// header; MaxHelloLen keeps it below that, and FromRaw ignores the field.
	binary.BigEndian.PutUint16(raw[3:], uint16(len(msg)))
	copy(raw[recordHeaderLen:], msg)
	h, err := parseMessage(raw[recordHeaderLen:])
	if err != nil {
		return nil, err
	}
	h.Raw = raw
	h.RecordVersion = recVersion
	return h, nil
}

// HelloRecordsLen reports how many bytes of records, starting at the
// beginning of b, carry a complete ClientHello: 0 and no error while more
// bytes are needed. A server reading the hello off a connection should loop
// on a [HelloScanner] instead, which does not look at a record twice.
func HelloRecordsLen(b []byte) (int, error) {
	var s HelloScanner
	return s.Scan(b)
}

// A HelloScanner measures the records of a ClientHello as they arrive. Its
// zero value is ready to use.
type HelloScanner struct {
	off    int     // where the first record not yet scanned starts
	have   int     // handshake bytes in the records scanned
	msgLen int     // the hello's length, once hdr is complete
	hdr    [4]byte // the handshake header, which may itself be split
}

// Scan is HelloRecordsLen for b, the bytes read so far, which must only
// have grown since the last call. It resumes after the records it has
// already scanned: calling HelloRecordsLen on every read was quadratic, and
// a hello sent in 1-byte records (11,000 of them fit the size limit) took
// a second of CPU per connection. After an error or a result other than 0,
// the scanner is spent.
func (s *HelloScanner) Scan(b []byte) (int, error) {
	for {
		off := s.off
		if len(b)-off < recordHeaderLen {
			return 0, nil
		}
		if b[off] != recordTypeHandshake {
			return 0, ErrNotHandshake
		}
		if b[off+1] != 3 { // SSL 3.0 and every TLS version have major 3
			return 0, ErrNotHandshake
		}
		n := int(binary.BigEndian.Uint16(b[off+3:]))
		if n == 0 || n > maxPlaintext+256 {
			return 0, fmt.Errorf("fingerprint: TLS record of %d bytes", n)
		}
		if len(b)-off-recordHeaderLen < n {
			return 0, nil
		}
		frag := b[off+recordHeaderLen : off+recordHeaderLen+n]
		s.off += recordHeaderLen + n
		if s.have < 4 {
			k := copy(s.hdr[s.have:], frag)
			s.have += k
			if s.have < 4 {
				continue
			}
			if s.hdr[0] != typeClientHello {
				return 0, fmt.Errorf("fingerprint: handshake message type %d, not ClientHello", s.hdr[0])
			}
			s.msgLen = int(s.hdr[1])<<16 | int(s.hdr[2])<<8 | int(s.hdr[3])
			if s.msgLen+4 > MaxHelloLen {
				return 0, fmt.Errorf("fingerprint: ClientHello of %d bytes exceeds %d", s.msgLen, MaxHelloLen)
			}
			s.have += len(frag) - k
		} else {
			s.have += len(frag)
		}
		switch {
		case s.have == s.msgLen+4:
			return s.off, nil
		case s.have > s.msgLen+4:
			return 0, errors.New("fingerprint: data after the ClientHello in its record")
		}
	}
}

// joinRecords checks that records is exactly the records of one ClientHello
// and returns the handshake message and the first record's version.
func joinRecords(records []byte) (msg []byte, version uint16, err error) {
	n, err := HelloRecordsLen(records)
	if err != nil {
		return nil, 0, err
	}
	if n == 0 {
		return nil, 0, errors.New("fingerprint: truncated ClientHello")
	}
	if n != len(records) {
		return nil, 0, errors.New("fingerprint: data after the ClientHello records")
	}
	version = binary.BigEndian.Uint16(records[1:])
	for off := 0; off < n; {
		l := int(binary.BigEndian.Uint16(records[off+3:]))
		msg = append(msg, records[off+recordHeaderLen:off+recordHeaderLen+l]...)
		off += recordHeaderLen + l
	}
	return msg, version, nil
}

// reader is a bounds-checked cursor; every read reports whether it fit.
type reader []byte

func (r *reader) u8(v *uint8) bool {
	if len(*r) < 1 {
		return false
	}
	*v = (*r)[0]
	*r = (*r)[1:]
	return true
}

func (r *reader) u16(v *uint16) bool {
	if len(*r) < 2 {
		return false
	}
	*v = binary.BigEndian.Uint16(*r)
	*r = (*r)[2:]
	return true
}

func (r *reader) bytes(n int, v *[]byte) bool {
	if n < 0 || len(*r) < n {
		return false
	}
	*v = (*r)[:n:n]
	*r = (*r)[n:]
	return true
}

func (r *reader) vec8(v *[]byte) bool {
	var n uint8
	return r.u8(&n) && r.bytes(int(n), v)
}

func (r *reader) vec16(v *[]byte) bool {
	var n uint16
	return r.u16(&n) && r.bytes(int(n), v)
}

func (r *reader) vec24(v *[]byte) bool {
	if len(*r) < 3 {
		return false
	}
	n := int((*r)[0])<<16 | int((*r)[1])<<8 | int((*r)[2])
	*r = (*r)[3:]
	return r.bytes(n, v)
}

// u16s decodes a list of big-endian uint16 values.
func u16s(b []byte) ([]uint16, bool) {
	if len(b)%2 != 0 {
		return nil, false
	}
	out := make([]uint16, len(b)/2)
	for i := range out {
		out[i] = binary.BigEndian.Uint16(b[2*i:])
	}
	return out, true
}

// parseMessage parses a ClientHello handshake message (4-byte header
// included).
func parseMessage(msg []byte) (*ClientHello, error) {
	r := reader(msg)
	var typ uint8
	var body []byte
	if !r.u8(&typ) || typ != typeClientHello || !r.vec24(&body) || len(r) != 0 {
		return nil, errors.New("fingerprint: malformed handshake header")
	}
	h := &ClientHello{}
	b := reader(body)
	var suites []byte
	if !b.u16(&h.Version) || !b.bytes(32, &h.Random) || !b.vec8(&h.SessionID) ||
		!b.vec16(&suites) || !b.vec8(&h.CompressionMethods) {
		return nil, errors.New("fingerprint: malformed ClientHello")
	}
	if len(h.SessionID) > 32 {
		return nil, errors.New("fingerprint: session id longer than 32 bytes")
	}
	var ok bool
	if h.CipherSuites, ok = u16s(suites); !ok {
		return nil, errors.New("fingerprint: odd cipher suites length")
	}
	if len(b) == 0 {
		return h, nil
	}
	var exts []byte
	if !b.vec16(&exts) || len(b) != 0 {
		return nil, errors.New("fingerprint: malformed extensions block")
	}
	h.HasExtensions = true
	e := reader(exts)
	seen := make(map[uint16]bool)
	for len(e) > 0 {
		var x Extension
		if !e.u16(&x.Type) || !e.vec16(&x.Data) {
			return nil, errors.New("fingerprint: malformed extension")
		}
		// RFC 8446 §4.2: no two extensions of one type. GREASE values repeat
		// legitimately only by accident of the random pick, which BoringSSL
		// avoids; treat any repeat as malformed, as servers do.
		if seen[x.Type] {
			return nil, fmt.Errorf("fingerprint: duplicate extension %#04x", x.Type)
		}
		seen[x.Type] = true
		if err := h.decodeExtension(x); err != nil {
			return nil, err
		}
		h.Extensions = append(h.Extensions, x)
	}
	return h, nil
}

// decodeExtension fills the decoded fields from the extensions that carry
// them.
func (h *ClientHello) decodeExtension(x Extension) error {
	d := reader(x.Data)
	bad := func() error { return fmt.Errorf("fingerprint: malformed extension %#04x", x.Type) }
	var list []byte
	var ok bool
	switch x.Type {
	case ExtServerName:
		if !d.vec16(&list) || len(d) != 0 {
			return bad()
		}
		for l := reader(list); len(l) > 0; {
			var typ uint8
			var name []byte
			if !l.u8(&typ) || !l.vec16(&name) {
				return bad()
			}
			if typ == 0 && h.ServerName == "" {
				h.ServerName = string(name)
			}
		}
	case ExtALPN:
		if !d.vec16(&list) || len(d) != 0 {
			return bad()
		}
		for l := reader(list); len(l) > 0; {
			var p []byte
			if !l.vec8(&p) {
				return bad()
			}
			h.ALPN = append(h.ALPN, string(p))
		}
	case ExtSupportedVersions:
		if !d.vec8(&list) || len(d) != 0 {
			return bad()
		}
		if h.SupportedVersions, ok = u16s(list); !ok {
			return bad()
		}
	case ExtSignatureAlgorithms:
		if !d.vec16(&list) || len(d) != 0 {
			return bad()
		}
		if h.SignatureAlgorithms, ok = u16s(list); !ok {
			return bad()
		}
	case ExtSupportedGroups:
		if !d.vec16(&list) || len(d) != 0 {
			return bad()
		}
		if h.SupportedGroups, ok = u16s(list); !ok {
			return bad()
		}
	case ExtPointFormats:
		if !d.vec8(&list) || len(d) != 0 {
			return bad()
		}
		h.PointFormats = list
	case ExtKeyShare:
		if !d.vec16(&list) || len(d) != 0 {
			return bad()
		}
		for l := reader(list); len(l) > 0; {
			var g uint16
			var key []byte
			if !l.u16(&g) || !l.vec16(&key) {
				return bad()
			}
			h.KeyShareGroups = append(h.KeyShareGroups, g)
		}
	}
	return nil
}

// Extension returns the extension of type typ and whether the hello has it.
func (h *ClientHello) Extension(typ uint16) (Extension, bool) {
	for _, x := range h.Extensions {
		if x.Type == typ {
			return x, true
		}
	}
	return Extension{}, false
}

// IsGREASE reports whether v is one of the GREASE values of RFC 8701
// (0x0a0a, 0x1a1a, ... 0xfafa), which clients sprinkle into every list to
// keep servers tolerant of unknown values.
func IsGREASE(v uint16) bool {
	return v&0x0f0f == 0x0a0a && v>>8 == v&0xff
}

// marshal builds the handshake record from the parsed fields. ParseClientHello
// of the result gives back h; the fuzz test holds the parser to that.
func (h *ClientHello) marshal() []byte {
	var body []byte
	body = binary.BigEndian.AppendUint16(body, h.Version)
	body = append(body, h.Random...)
	body = append(body, byte(len(h.SessionID)))
	body = append(body, h.SessionID...)
	body = binary.BigEndian.AppendUint16(body, uint16(2*len(h.CipherSuites)))
	for _, c := range h.CipherSuites {
		body = binary.BigEndian.AppendUint16(body, c)
	}
	body = append(body, byte(len(h.CompressionMethods)))
	body = append(body, h.CompressionMethods...)
	if h.HasExtensions {
		var exts []byte
		for _, x := range h.Extensions {
			exts = binary.BigEndian.AppendUint16(exts, x.Type)
			exts = binary.BigEndian.AppendUint16(exts, uint16(len(x.Data)))
			exts = append(exts, x.Data...)
		}
		body = binary.BigEndian.AppendUint16(body, uint16(len(exts)))
		body = append(body, exts...)
	}
	msg := []byte{typeClientHello, byte(len(body) >> 16), byte(len(body) >> 8), byte(len(body))}
	msg = append(msg, body...)
	rec := []byte{recordTypeHandshake, byte(h.RecordVersion >> 8), byte(h.RecordVersion), byte(len(msg) >> 8), byte(len(msg))}
	return append(rec, msg...)
}
