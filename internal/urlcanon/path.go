package urlcanon

import (
	"bytes"
	"net/url"
	"strings"
)

// appendPath appends the canonical path of u.
func appendPath(b []byte, u *url.URL) []byte {
	// RawPath keeps the client's escaping ("/a%2Fb", whose Path is "/a/b").
	// Use it whenever it encodes Path, even if EscapedPath would reject it
	// for holding raw bytes that need escaping: EscapedPath would then
	// re-escape Path and turn %2F into '/'.
	src := u.RawPath
	if src == "" || !unescapesTo(src, u.Path) {
		src = u.EscapedPath()
	}
	start := len(b)
	if !strings.HasPrefix(src, "/") {
		b = append(b, '/')
	}
	b = appendNormalized(b, src, classPath)
	return b[:start+len(removeDotSegments(b[start:]))]
}

// unescapesTo reports whether percent-decoding raw yields exactly path.
func unescapesTo(raw, path string) bool {
	j := 0
	for i := 0; i < len(raw); i, j = i+1, j+1 {
		c := raw[i]
		if c == '%' {
			if i+2 >= len(raw) || !ishex(raw[i+1]) || !ishex(raw[i+2]) {
				return false
			}
			c = unhex(raw[i+1])<<4 | unhex(raw[i+2])
			i += 2
		}
		if j >= len(path) || path[j] != c {
			return false
		}
	}
	return j == len(path)
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
