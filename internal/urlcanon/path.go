package urlcanon

import (
	"bytes"
	"net/url"
	"strings"
)

// Path returns the canonical path of u, as Append writes it: the path a
// key names. Whatever decides how a request is keyed by its path (a
// dedup rule's path_prefix) must look at this one, not at u.Path, or
// "/public/../private" would be keyed as "/private" under the rule for
// "/public".
func Path(u *url.URL) string {
	if src := u.EscapedPath(); plainPath(src) {
		return src // what appendPath would write, without copying it
	}
	return string(appendPath(nil, u))
}

// A Prefix is a configured path prefix (a rule's path_prefix) written as
// Path writes paths, so that it is matched against the path a request is
// keyed under and most origins answer: "/public/../private/x" is not
// under "/public/", and "/%61pi/x" is under "/api/". It is the one path
// matcher of the configuration, as hostmatch is the one host matcher. The
// zero Prefix matches every path.
type Prefix struct{ p string }

// NewPrefix compiles prefix, as a configuration writes it (decoded:
// "/café/").
func NewPrefix(prefix string) Prefix {
	if prefix == "" {
		return Prefix{}
	}
	return Prefix{Path(&url.URL{Path: prefix})}
}

// Match reports whether path, a Path result, starts with the prefix.
func (p Prefix) Match(path string) bool { return strings.HasPrefix(path, p.p) }

// IsZero reports whether the prefix matches every path.
func (p Prefix) IsZero() bool { return p.p == "" }

// plainPath reports whether appendPath leaves the escaped path p as it is:
// it starts with '/', holds no escape and nothing to escape, and no "/."
// that could start a dot-segment.
func plainPath(p string) bool {
	if !strings.HasPrefix(p, "/") || strings.Contains(p, "/.") {
		return false
	}
	for i := 0; i < len(p); i++ {
		if c := p[i]; c == '%' || charClass[c]&classPath == 0 {
			return false
		}
	}
	return true
}

// appendPath appends the canonical path of u.
func appendPath(b []byte, u *url.URL) []byte {
	// The key must name the request the origin receives, and the proxy
	// writes the request target with u.RequestURI, that is EscapedPath:
	// the client's escaping (RawPath, "/a%2Fb" for the Path "/a/b") when it
	// is a valid encoding, else Path re-escaped, where "%2F" has become
	// '/' ("/a%2Fb|" goes out as "/a/b%7C"). Keying RawPath in that case
	// gave "/a%2Fb|" the key of "/a%2Fb%7C", a different request that was
	// then served the other's response.
	src := u.EscapedPath()
	start := len(b)
	if !strings.HasPrefix(src, "/") {
		b = append(b, '/')
	}
	b = appendNormalized(b, src, classPath)
	return b[:start+len(removeDotSegments(b[start:]))]
}

// hasDotSegment reports whether the path p has a "." or ".." segment.
func hasDotSegment(p []byte) bool {
	for i := 0; i < len(p); i++ {
		if p[i] != '/' {
			continue
		}
		seg := p[i+1:]
		if j := bytes.IndexByte(seg, '/'); j >= 0 {
			seg = seg[:j]
		}
		if string(seg) == "." || string(seg) == ".." {
			return true
		}
	}
	return false
}

// removeDotSegments applies RFC 3986 section 5.2.4 in place to p, which
// starts with '/', and returns the result. Steps 2A and 2D cannot apply
// to a path that starts with '/'.
func removeDotSegments(p []byte) []byte {
	if !hasDotSegment(p) {
		return p
	}
	w := 0 // p[:w] is the output buffer; it never overtakes the input p[i:]
	for i := 0; i < len(p); {
		in := p[i:]
		switch {
		case bytes.HasPrefix(in, []byte("/./")): // 2B
			i += 2
		case string(in) == "/.": // 2B
			i++
			p[i] = '/'
		case bytes.HasPrefix(in, []byte("/../")): // 2C
			i += 3
			w = max(bytes.LastIndexByte(p[:w], '/'), 0)
		case string(in) == "/..": // 2C
			i += 2
			p[i] = '/'
			w = max(bytes.LastIndexByte(p[:w], '/'), 0)
		default: // 2E: move "/segment" to the output
			j := 1
			for j < len(in) && in[j] != '/' {
				j++
			}
			w += copy(p[w:], in[:j])
			i += j
		}
	}
	return p[:w]
}
