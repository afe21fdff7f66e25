package urlcanon

import (
	"bytes"
	"slices"
	"strings"
)

// qparam locates one normalized query parameter in the output buffer.
type qparam struct {
	start, nameEnd, end int
}

// appendQuery appends "?" and the canonical form of the raw query, or nothing
// if no parameter is left.
func appendQuery(b []byte, raw string, ignoreParams []string) []byte {
	if raw == "" {
		return b
	}
	mark := len(b)
	b = append(b, '?')
	base := len(b)
	var parr [16]qparam
	params := parr[:0]
	for raw != "" {
		var piece string
		piece, raw, _ = strings.Cut(raw, "&")
		if piece == "" {
			continue
		}
		pmark := len(b)
		if len(params) > 0 {
			b = append(b, '&')
		}
		start := len(b)
		name, value, hasValue := strings.Cut(piece, "=")
		b = appendNormalized(b, name, classQuery)
		nameEnd := len(b)
		if ignored(b[start:nameEnd], ignoreParams) {
			b = b[:pmark]
			continue
		}
		if hasValue {
			b = append(b, '=')
			b = appendNormalized(b, value, classQuery)
		}
		params = append(params, qparam{start, nameEnd, len(b)})
	}
	if len(params) == 0 {
		return b[:mark]
	}
	// Names compare as a form decoder reads them ('+' a space, escapes
	// decoded): "a+b" and "a%20b" are one name to a server, and its values
	// must keep their order whichever way each was spelled. A comparison
	// decodes into buffers it reuses: allocating a decoded name in each
	// one made a head of thousands of escaped names cost a hundred
	// thousand allocations.
	var xbuf, ybuf []byte
	name := func(buf *[]byte, p qparam) []byte {
		n := b[p.start:p.nameEnd]
		if bytes.IndexByte(n, '%') < 0 && bytes.IndexByte(n, '+') < 0 {
			return n
		}
		*buf = appendFormDecoded((*buf)[:0], n)
		return *buf
	}
	cmp := func(x, y qparam) int { return bytes.Compare(name(&xbuf, x), name(&ybuf, y)) }
	if slices.IsSortedFunc(params, cmp) {
		return b
	}
	slices.SortStableFunc(params, cmp)
	var tarr [256]byte
	tmp := append(tarr[:0], b[base:]...)
	b = b[:base]
	for i, p := range params {
		if i > 0 {
			b = append(b, '&')
		}
		b = append(b, tmp[p.start-base:p.end-base]...)
	}
	return b
}

// appendFormDecoded appends the normalized query component s decoded as a
// form decoder reads it: '+' a space, escapes decoded. Normalized, every
// '%' in s starts a valid escape.
func appendFormDecoded(dst, s []byte) []byte {
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '+':
			dst = append(dst, ' ')
		case '%':
			dst = append(dst, unhex(s[i+1])<<4|unhex(s[i+2]))
			i += 2
		default:
			dst = append(dst, c)
		}
	}
	return dst
}

// ignored reports whether the query parameter with the normalized name is
// dropped by ignoreParams.
func ignored(name []byte, ignoreParams []string) bool {
	if len(ignoreParams) == 0 {
		return false
	}
	if bytes.IndexByte(name, '%') >= 0 || bytes.IndexByte(name, '+') >= 0 {
		var arr [64]byte
		name = appendFormDecoded(arr[:0], name)
	}
	for _, p := range ignoreParams {
		if prefix, ok := strings.CutSuffix(p, "*"); ok {
			if len(name) >= len(prefix) && string(name[:len(prefix)]) == prefix {
				return true
			}
		} else if string(name) == p {
			return true
		}
	}
	return false
}
