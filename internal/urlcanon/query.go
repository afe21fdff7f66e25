package urlcanon

import (
	"bytes"
	"net/url"
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
	// must keep their order whichever way each was spelled.
	name := func(p qparam) []byte {
		n := b[p.start:p.nameEnd]
		if bytes.IndexByte(n, '%') < 0 && bytes.IndexByte(n, '+') < 0 {
			return n
		}
		// Normalized, so every '%' starts a valid escape.
		decoded, _ := url.QueryUnescape(string(n))
		return []byte(decoded)
	}
	cmp := func(x, y qparam) int { return bytes.Compare(name(x), name(y)) }
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

// ignored reports whether the query parameter with the normalized name is
// dropped by ignoreParams.
func ignored(name []byte, ignoreParams []string) bool {
	if len(ignoreParams) == 0 {
		return false
	}
	if bytes.IndexByte(name, '%') >= 0 || bytes.IndexByte(name, '+') >= 0 {
		// Normalized, so every '%' starts a valid escape.
		decoded, _ := url.QueryUnescape(string(name))
		name = []byte(decoded)
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
