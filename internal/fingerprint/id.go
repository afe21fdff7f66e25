package fingerprint

import (
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"slices"
)

// A Fingerprint is what a client connection showed an origin before its
// first request: the ClientHello and, for an HTTP/2 client, the preface.
// Build one with [New]; it is read-only afterwards.
type Fingerprint struct {
	Hello *ClientHello
	H2    *H2 // nil for an HTTP/1.x client
	id    ID
}

// New returns the fingerprint of a connection; h2 is nil for HTTP/1.x.
func New(hello *ClientHello, h2 *H2) *Fingerprint {
	f := &Fingerprint{Hello: hello, H2: h2}
	f.id = computeID(hello, h2)
	return f
}

// ID returns the fingerprint's identity.
func (f *Fingerprint) ID() ID {
	if f.id == (ID{}) {
		return computeID(f.Hello, f.H2)
	}
	return f.id
}

// An ID identifies a fingerprint: equal IDs mean an origin cannot tell the
// two connections apart by their hello or preface. It is comparable, so a
// pool can key on it.
type ID [16]byte

// String returns the ID in hex.
func (id ID) String() string { return hex.EncodeToString(id[:]) }

// greaseMark stands for every GREASE value in the normalized form: the
// mirror re-randomizes them, so only their positions are the client's.
const greaseMark = 0x0a0a

func normGREASE(v uint16) uint16 {
	if IsGREASE(v) {
		return greaseMark
	}
	return v
}

// computeID hashes the parts of the hello and the preface a mirrored
// connection reproduces, with what varies per connection normalized away:
//   - the randoms, session id and key share bytes (fresh per connection);
//   - GREASE values (positions kept);
//   - the SNI and the padding length (which follows the SNI's length);
//   - the contents of GREASE ECH, session tickets and GREASE extensions;
//   - pre_shared_key and early_data, which the mirror never sends;
//   - the extension order: Chrome shuffles it on every connection, so two
//     connections of one browser would otherwise never share a pool, and a
//     browser's origin sees every order anyway.
func computeID(h *ClientHello, h2 *H2) ID {
	var b []byte
	b = append(b, "fp1"...)
	if h != nil {
		b = binary.BigEndian.AppendUint16(b, h.Version)
		b = appendList(b, h.CipherSuites)
		b = append(b, byte(len(h.CompressionMethods)))
		b = append(b, h.CompressionMethods...)
		exts := make([]Extension, 0, len(h.Extensions))
		for _, x := range h.Extensions {
			if x.Type == ExtPreSharedKey || x.Type == ExtEarlyData {
				continue
			}
			exts = append(exts, Extension{Type: normGREASE(x.Type), Data: normalizedData(x)})
		}
		slices.SortStableFunc(exts, func(a, b Extension) int { return cmp.Compare(a.Type, b.Type) })
		b = binary.BigEndian.AppendUint16(b, uint16(len(exts)))
		for _, x := range exts {
			b = binary.BigEndian.AppendUint16(b, x.Type)
			b = binary.BigEndian.AppendUint32(b, uint32(len(x.Data)))
			b = append(b, x.Data...)
		}
	}
	b = append(b, 0xff)
	if h2 != nil {
		b = append(b, h2.Akamai()...)
		b = binary.BigEndian.AppendUint32(b, h2.FirstStreamID)
	}
	sum := sha256.Sum256(b)
	var id ID
	copy(id[:], sum[:])
	return id
}

// normalizedData is an extension's data with its per-connection parts
// removed.
func normalizedData(x Extension) []byte {
	switch {
	case IsGREASE(x.Type), x.Type == ExtServerName, x.Type == ExtPadding,
		x.Type == ExtSessionTicket, x.Type == ExtECH:
		return nil
	case x.Type == ExtKeyShare:
		h := &ClientHello{}
		if h.decodeExtension(x) != nil {
			return x.Data
		}
		return appendList(nil, h.KeyShareGroups)
	case x.Type == ExtSupportedGroups, x.Type == ExtSignatureAlgorithms:
		// A uint16 length, then uint16 values.
		if len(x.Data) < 2 || len(x.Data)%2 != 0 {
			return x.Data
		}
		out := slices.Clone(x.Data)
		for i := 2; i < len(out); i += 2 {
			binary.BigEndian.PutUint16(out[i:], normGREASE(binary.BigEndian.Uint16(out[i:])))
		}
		return out
	case x.Type == ExtSupportedVersions:
		// A uint8 length, then uint16 values.
		if len(x.Data) < 1 || len(x.Data)%2 != 1 {
			return x.Data
		}
		out := slices.Clone(x.Data)
		for i := 1; i < len(out); i += 2 {
			binary.BigEndian.PutUint16(out[i:], normGREASE(binary.BigEndian.Uint16(out[i:])))
		}
		return out
	}
	return x.Data
}

func appendList(b []byte, vs []uint16) []byte {
	b = binary.BigEndian.AppendUint16(b, uint16(len(vs)))
	for _, v := range vs {
		b = binary.BigEndian.AppendUint16(b, normGREASE(v))
	}
	return b
}
