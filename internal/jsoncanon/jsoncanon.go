// Package jsoncanon writes the canonical form of a JSON value, so that two
// request bodies that differ only in whitespace or in the order of object
// members key alike, and finds the members of a top-level object, so that a
// key can take just some of them.
//
// The canonical form drops insignificant whitespace and sorts object members
// by decoded name; nothing else changes. Strings and numbers keep their
// literal spelling, so "\u0041" and "A", or 1 and 1.0, stay distinct:
// telling them apart is never wrong, merging them could be. An object that
// repeats a member name, or has two names equal but for case (which
// encoding/json, matching struct fields, reads as one), has no canonical
// form, because parsers disagree on which member wins.
//
// It is hand-written rather than built on encoding/json or an RFC 8785
// (JCS) library because both rewrite values: decoding into any turns
// numbers into float64 (2^53+1 becomes 2^53) and lets the last repeated
// name win, json.Marshal re-escapes strings, and JCS normalizes number and
// string spellings. Any of these would merge bodies that a server may tell
// apart, and the output is hashed into keys shared by a fleet, so it must
// not change with a library. encoding/json only validates the input.
package jsoncanon

import (
	"bytes"
	"encoding/json"
	"slices"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// maxDepth bounds nesting: a value nested deeper has no canonical form.
// A top-level value is at depth 1, and so is a member of a top-level object.
const maxDepth = 64

// A Member is one member of a JSON object.
type Member struct {
	Name  string // decoded
	lit   []byte // the name's string literal, quotes included
	value []byte // the raw value
}

// Append appends the canonical form of the JSON text doc to dst. It reports
// false, with dst unchanged, if doc is not valid UTF-8 JSON, repeats a
// member name in an object (or has two equal but for case), or nests
// deeper than 64 levels.
func Append(dst, doc []byte) ([]byte, bool) {
	if !valid(doc) {
		return dst, false
	}
	b, ok := appendValue(dst, bytes.Trim(doc, " \t\r\n"), 1)
	if !ok {
		return dst, false
	}
	return b, true
}

// Object returns the members of doc, a JSON text holding an object, sorted
// by Name. It reports false if doc is not valid UTF-8 JSON or not an object,
// if two members share a decoded name (or have names equal but for case),
// or if a name cannot be decoded exactly (an escaped lone surrogate, which
// decoders turn into U+FFFD).
// Members of nested objects are not checked until their value is appended.
// The members point into doc, which must not change while they are in use.
func Object(doc []byte) ([]Member, bool) {
	if !valid(doc) {
		return nil, false
	}
	data := bytes.TrimLeft(doc, " \t\r\n")
	if data[0] != '{' {
		return nil, false
	}
	return object(data[:valueEnd(data, 0)])
}

// AppendValue appends the canonical form of m's value to dst, as [Append]
// would, the value being at depth 1. It reports false, with dst unchanged,
// for a repeated member name or nesting too deep.
func (m Member) AppendValue(dst []byte) ([]byte, bool) {
	b, ok := appendValue(dst, m.value, 1)
	if !ok {
		return dst, false
	}
	return b, true
}

// valid reports whether doc is one JSON value in UTF-8. Decoders replace
// invalid UTF-8 with U+FFFD, so different member names could decode alike
// (and RFC 8259 requires UTF-8 anyway). Everything below relies on it: the
// scanners skip the checks json.Valid made.
func valid(doc []byte) bool {
	return utf8.Valid(doc) && json.Valid(doc)
}

// isSpace reports whether c is JSON insignificant whitespace.
func isSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\r' || c == '\n'
}

// skipSpace returns the index of the first non-space byte at or after i.
func skipSpace(data []byte, i int) int {
	for i < len(data) && isSpace(data[i]) {
		i++
	}
	return i
}

// valueEnd returns the end of the value that starts at data[i]. data must
// be valid JSON, so the scan needs no error handling.
func valueEnd(data []byte, i int) int {
	switch data[i] {
	case '"':
		for j := i + 1; ; j++ {
			switch data[j] {
			case '\\':
				j++
			case '"':
				return j + 1
			}
		}
	case '{', '[':
		depth := 0
		for j := i; ; j++ {
			switch data[j] {
			case '"':
				j = valueEnd(data, j) - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return j + 1
				}
			}
		}
	default: // number, true, false, null
		j := i
		for j < len(data) && !isSpace(data[j]) && data[j] != ',' && data[j] != '}' && data[j] != ']' {
			j++
		}
		return j
	}
}

// object returns the members of the valid JSON object data, sorted by
// decoded name. It reports false if two members share a decoded name, or
// names equal but for case, or a name cannot be decoded exactly.
func object(data []byte) ([]Member, bool) {
	var members []Member
	i := skipSpace(data, 1)
	for data[i] != '}' {
		ke := valueEnd(data, i)
		name, ok := decodeString(data[i:ke])
		if !ok {
			return nil, false
		}
		vs := skipSpace(data, skipSpace(data, ke)+1) // past ':'
		ve := valueEnd(data, vs)
		members = append(members, Member{Name: name, lit: data[i:ke], value: data[vs:ve]})
		i = skipSpace(data, ve)
		if data[i] == ',' {
			i = skipSpace(data, i+1)
		}
	}
	slices.SortFunc(members, func(x, y Member) int { return strings.Compare(x.Name, y.Name) })
	for i := 1; i < len(members); i++ {
		if members[i].Name == members[i-1].Name {
			return nil, false
		}
	}
	if foldCollide(members) {
		return nil, false
	}
	return members, true
}

// foldCollide reports whether two members' names are equal under Unicode
// case folding. encoding/json decodes an object into a struct matching
// names case-insensitively, and the last match wins (so do other
// frameworks when told to ignore case): {"method":"b","Method":"a"} is
// "a" to such a server, while a key that takes the member "method" reads
// "b", as it does for {"method":"b"}. Such names are as ambiguous as a
// repeated one.
func foldCollide(members []Member) bool {
	if len(members) < 2 {
		return false
	}
	seen := make(map[string]struct{}, len(members))
	for _, m := range members {
		f := foldName(m.Name)
		if _, ok := seen[f]; ok {
			return true
		}
		seen[f] = struct{}{}
	}
	return false
}

// foldName maps each rune of name to the least rune of its case-folding
// orbit, so that foldName(x) == foldName(y) exactly when
// strings.EqualFold(x, y) ("K", "k" and U+212A KELVIN SIGN all become "K").
func foldName(name string) string {
	return strings.Map(func(r rune) rune {
		least := r
		for f := unicode.SimpleFold(r); f != r; f = unicode.SimpleFold(f) {
			least = min(least, f)
		}
		return least
	}, name)
}

// appendValue appends the canonical form of the valid JSON value v, which
// is at the given depth. It reports false for a repeated member name or
// nesting deeper than maxDepth; dst then holds a partial value.
func appendValue(dst, v []byte, depth int) ([]byte, bool) {
	switch v[0] {
	case '{':
		if depth > maxDepth {
			return dst, false
		}
		members, ok := object(v)
		if !ok {
			return dst, false
		}
		dst = append(dst, '{')
		for i, m := range members {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = append(dst, m.lit...)
			dst = append(dst, ':')
			if dst, ok = appendValue(dst, m.value, depth+1); !ok {
				return dst, false
			}
		}
		return append(dst, '}'), true
	case '[':
		if depth > maxDepth {
			return dst, false
		}
		dst = append(dst, '[')
		i := skipSpace(v, 1)
		for first := true; v[i] != ']'; first = false {
			e := valueEnd(v, i)
			if !first {
				dst = append(dst, ',')
			}
			var ok bool
			if dst, ok = appendValue(dst, v[i:e], depth+1); !ok {
				return dst, false
			}
			i = skipSpace(v, e)
			if v[i] == ',' {
				i = skipSpace(v, i+1)
			}
		}
		return append(dst, ']'), true
	default:
		return append(dst, v...), true
	}
}

// decodeString decodes the valid JSON string literal lit (quotes included).
// Raw bytes are kept as they are; it reports false for an escaped lone
// surrogate, which decoders replace with U+FFFD, so that two different names
// would decode alike.
func decodeString(lit []byte) (string, bool) {
	s := lit[1 : len(lit)-1]
	if bytes.IndexByte(s, '\\') < 0 {
		return string(s), true
	}
	out := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c != '\\' {
			out = append(out, c)
			continue
		}
		i++
		switch s[i] {
		case 'b':
			out = append(out, '\b')
		case 'f':
			out = append(out, '\f')
		case 'n':
			out = append(out, '\n')
		case 'r':
			out = append(out, '\r')
		case 't':
			out = append(out, '\t')
		case 'u':
			r := hex4(s[i+1 : i+5])
			i += 4
			if utf16.IsSurrogate(r) {
				if r >= 0xDC00 || i+6 >= len(s) || s[i+1] != '\\' || s[i+2] != 'u' {
					return "", false
				}
				r2 := hex4(s[i+3 : i+7])
				if r2 < 0xDC00 || r2 > 0xDFFF {
					return "", false
				}
				r = utf16.DecodeRune(r, r2)
				i += 6
			}
			out = utf8.AppendRune(out, r)
		default: // '"', '\\', '/'
			out = append(out, s[i])
		}
	}
	return string(out), true
}

// hex4 decodes four hex digits, already validated by json.Valid.
func hex4(h []byte) rune {
	var r rune
	for _, c := range h {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		default:
			c -= 'A' - 10
		}
		r = r<<4 | rune(c)
	}
	return r
}
