package fingerprint

import (
	"encoding/binary"
	"strconv"
	"strings"
	"testing"
)

// helloSpec describes a ClientHello to build in a test.
type helloSpec struct {
	version    uint16
	ciphers    []uint16
	exts       []uint16 // wire order; data comes from the fields below or is empty
	sni        string
	alpn       []string
	versions   []uint16
	sigAlgs    []uint16
	groups     []uint16
	points     []uint8
	keyShares  []uint16
	sessionLen int
}

func u16list(vs []uint16, lenBytes int) []byte {
	var b []byte
	n := 2 * len(vs)
	if lenBytes == 1 {
		b = append(b, byte(n))
	} else {
		b = binary.BigEndian.AppendUint16(b, uint16(n))
	}
	for _, v := range vs {
		b = binary.BigEndian.AppendUint16(b, v)
	}
	return b
}

// build returns the hello as one TLS record.
func (s helloSpec) build() []byte {
	h := &ClientHello{
		RecordVersion:      0x0301,
		Version:            s.version,
		Random:             make([]byte, 32),
		SessionID:          make([]byte, s.sessionLen),
		CipherSuites:       s.ciphers,
		CompressionMethods: []uint8{0},
		HasExtensions:      true,
	}
	if h.Version == 0 {
		h.Version = 0x0303
	}
	for _, t := range s.exts {
		var d []byte
		switch t {
		case ExtServerName:
			name := []byte(s.sni)
			d = binary.BigEndian.AppendUint16(nil, uint16(len(name)+3))
			d = append(d, 0)
			d = binary.BigEndian.AppendUint16(d, uint16(len(name)))
			d = append(d, name...)
		case ExtALPN:
			var l []byte
			for _, p := range s.alpn {
				l = append(l, byte(len(p)))
				l = append(l, p...)
			}
			d = binary.BigEndian.AppendUint16(nil, uint16(len(l)))
			d = append(d, l...)
		case ExtSupportedVersions:
			d = u16list(s.versions, 1)
		case ExtSignatureAlgorithms:
			d = u16list(s.sigAlgs, 2)
		case ExtSupportedGroups:
			d = u16list(s.groups, 2)
		case ExtPointFormats:
			d = append([]byte{byte(len(s.points))}, s.points...)
		case ExtKeyShare:
			var l []byte
			for _, g := range s.keyShares {
				l = binary.BigEndian.AppendUint16(l, g)
				l = binary.BigEndian.AppendUint16(l, 32)
				l = append(l, make([]byte, 32)...)
			}
			d = binary.BigEndian.AppendUint16(nil, uint16(len(l)))
			d = append(d, l...)
		}
		h.Extensions = append(h.Extensions, Extension{Type: t, Data: d})
	}
	return h.marshal()
}

// hexList parses "1301,1302" into values.
func hexList(t testing.TB, s string) []uint16 {
	t.Helper()
	var out []uint16
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.ParseUint(f, 16, 16)
		if err != nil {
			t.Fatalf("hexList(%q): %v", s, err)
		}
		out = append(out, uint16(v))
	}
	return out
}

// splitRecords re-frames a single-record hello into records of at most n
// bytes of fragment each.
func splitRecords(rec []byte, n int) []byte {
	msg := rec[recordHeaderLen:]
	var out []byte
	for len(msg) > 0 {
		k := min(n, len(msg))
		out = append(out, rec[0], rec[1], rec[2], byte(k>>8), byte(k))
		out = append(out, msg[:k]...)
		msg = msg[k:]
	}
	return out
}
