package urlcanon

import "strings"

// Character classes for percent-encoding normalization (RFC 3986 appendix A).
const (
	classUnreserved = 1 << iota // ALPHA / DIGIT / "-" / "." / "_" / "~"
	classPath                   // may appear raw in a path: pchar / "/"
	classQuery                  // may appear raw in a query: pchar / "/" / "?"
)

var charClass = func() (t [256]uint8) {
	for c := 0; c < 256; c++ {
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9',
			c == '-', c == '.', c == '_', c == '~':
			t[c] = classUnreserved | classPath | classQuery
		case strings.IndexByte("!$&'()*+,;=:@/", byte(c)) >= 0: // sub-delims, ":", "@", "/"
			t[c] = classPath | classQuery
		case c == '?':
			t[c] = classQuery
		}
	}
	return t
}()

const upperHex = "0123456789ABCDEF"

func ishex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

func unhex(c byte) byte {
	switch {
	case '0' <= c && c <= '9':
		return c - '0'
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10
	default:
		return c - 'A' + 10
	}
}

// appendNormalized appends s, a percent-encoded URL component, with its
// percent-encoding normalized: escapes of unreserved characters decoded, other
// escapes in upper-case hex, and every byte outside class (a stray '%'
// included) escaped.
func appendNormalized(b []byte, s string, class uint8) []byte {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c == '%' && i+2 < len(s) && ishex(s[i+1]) && ishex(s[i+2]) {
			c = unhex(s[i+1])<<4 | unhex(s[i+2])
			i += 2
			if charClass[c]&classUnreserved != 0 {
				b = append(b, c)
			} else {
				b = append(b, '%', upperHex[c>>4], upperHex[c&15])
			}
			continue
		}
		if c != '%' && charClass[c]&class != 0 {
			b = append(b, c)
		} else {
			b = append(b, '%', upperHex[c>>4], upperHex[c&15])
		}
	}
	return b
}
