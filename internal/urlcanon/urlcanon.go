// Package urlcanon writes the canonical form of an absolute http or https
// URL: one spelling for the many ways a client may write the same URL
// (case, default port, escapes, dot-segments, query order), so that
// requests for one resource get one cache key.
//
// It owns the normalization rules (RFC 3986 section 6.2.2 where it applies,
// plus the choices a cache key needs: which query parameters to drop, how
// repeated ones sort) and nothing else: no hashing, no HTTP semantics.
//
// It is hand-written rather than built on a URL-normalization library on
// purpose. Its output is hashed into keys that proxies of different builds
// share through one store, so a byte that changed with a dependency upgrade
// would silently split the fleet's cache. And general-purpose normalizers
// are lenient where a cache key must be strict: purell, say, rebuilds the
// query through url.Values, which merges "a" with "a=" and '+' with "%20"
// and sorts repeated values, so that two requests a server tells apart
// would share one response. net/url parses but does not normalize; this
// package reads what net/url parsed. Only IDNA is delegated, to
// golang.org/x/net/idna (UTS #46).
package urlcanon

import (
	"errors"
	"fmt"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"unicode/utf8"

	"golang.org/x/net/idna"
)

// ErrInvalid is wrapped by every error from [Append]: the URL is not an
// absolute http or https URL with a valid host, so it has no canonical form.
var ErrInvalid = errors.New("urlcanon: invalid URL")

// Append appends the canonical form of u to dst and returns the extended
// buffer, in the form scheme://host[:port]path[?query]. ignoreParams lists
// the query parameters to drop: an entry ending in '*' is a prefix match
// ("utm_*"); matching is case-sensitive on the decoded name, '+' decoding to
// a space as in forms. nil drops none. On error, Append returns dst
// unchanged and an error wrapping [ErrInvalid].
//
// Normalization, following RFC 3986 section 6.2.2 where it applies:
//   - The scheme is lower-cased; only http and https are accepted. The URL
//     must be absolute, with a host.
//   - The host is lower-cased. A host with non-ASCII characters is converted
//     with IDNA (idna.Lookup.ToASCII); an invalid one is an error. An ASCII host
//     is only lower-cased and checked for letters, digits, '-', '_' and '.'
//     (like net/http, which skips IDNA for ASCII hosts: the IDNA lookup rules
//     reject real host names such as "a_b.example" or "r3---sn-x.example").
//     One trailing dot is removed; empty labels are an error. IPv6 literals
//     stay bracketed and are written in RFC 5952 form; a zone is kept
//     (only unreserved characters are accepted in it).
//   - The default port (http 80, https 443) and an empty port are dropped;
//     other ports are kept, without leading zeros.
//   - Userinfo and fragment are dropped.
//   - Path: the path the request goes out with (u.EscapedPath, as
//     u.RequestURI writes it: the client's escaping when it is valid, else
//     Path re-escaped, "%2F" then being '/'); empty becomes "/".
//     Percent-encoding is normalized first: escapes of unreserved
//     characters (ALPHA / DIGIT / "-" / "." / "_" / "~") are decoded, other
//     escapes get upper-case hex, and characters that may not appear raw
//     are escaped ("%2f" becomes "%2F", never "/"). Then
//     dot-segments are removed (RFC 3986 section 5.2.4), so "%2E%2E" is a
//     dot-segment, as RFC 3986 section 6.2.2.3 and browsers have it.
//     Duplicate slashes are kept.
//   - Query: split on '&' (empty pieces dropped), each piece split into name
//     and value at the first '='; percent-encoding normalized as in paths,
//     '+' kept as is (not equated with %20). Parameters whose decoded name is
//     ignored are dropped; the rest are sorted by name as a form decoder
//     reads it ('+' a space, escapes decoded), bytewise and stably, so
//     repeated parameters keep their relative order ("a=2&a=1" differs from
//     "a=1&a=2": servers read the first or the last one), also when they
//     are spelled differently ("a+b=1&a%20b=2"). "a" and "a=" differ. A
//     query left empty drops the '?'.
//   - A '%' that does not start a valid escape is taken literally and
//     written as "%25".
func Append(dst []byte, u *url.URL, ignoreParams []string) ([]byte, error) {
	b, err := appendURL(dst, u, ignoreParams)
	if err != nil {
		return dst, err
	}
	return b, nil
}

func appendURL(b []byte, u *url.URL, ignoreParams []string) ([]byte, error) {
	if u == nil {
		return b, fmt.Errorf("%w: nil URL", ErrInvalid)
	}
	var https bool
	switch {
	case strings.EqualFold(u.Scheme, "http"):
	case strings.EqualFold(u.Scheme, "https"):
		https = true
	case u.Scheme == "":
		return b, fmt.Errorf("%w: not absolute", ErrInvalid)
	default:
		return b, fmt.Errorf("%w: unsupported scheme %q", ErrInvalid, u.Scheme)
	}
	if u.Opaque != "" || u.Host == "" {
		return b, fmt.Errorf("%w: no host", ErrInvalid)
	}
	if https {
		b = append(b, "https://"...)
	} else {
		b = append(b, "http://"...)
	}
	b, err := appendHostPort(b, u.Host, https)
	if err != nil {
		return b, err
	}
	b = appendPath(b, u)
	return appendQuery(b, u.RawQuery, ignoreParams), nil
}

// appendHostPort appends the canonical host and port of hostport, a
// url.URL.Host.
func appendHostPort(b []byte, hostport string, https bool) ([]byte, error) {
	host, port := hostport, ""
	var err error
	if strings.HasPrefix(host, "[") {
		end := strings.LastIndexByte(host, ']')
		if end < 0 {
			return b, fmt.Errorf("%w: host %q: missing ']'", ErrInvalid, hostport)
		}
		if rest := host[end+1:]; rest != "" {
			if rest[0] != ':' {
				return b, fmt.Errorf("%w: host %q: junk after ']'", ErrInvalid, hostport)
			}
			port = rest[1:]
		}
		b, err = appendIPv6(b, host[1:end])
	} else {
		if i := strings.LastIndexByte(host, ':'); i >= 0 {
			host, port = host[:i], host[i+1:]
		}
		b, err = appendRegName(b, host)
	}
	if err != nil {
		return b, err
	}
	return appendPort(b, port, https)
}

// appendIPv6 appends the bracketed IPv6 literal lit (without brackets, zone
// after '%' unescaped, as url.Parse leaves it) in RFC 5952 form.
func appendIPv6(b []byte, lit string) ([]byte, error) {
	addr, zone, hasZone := strings.Cut(lit, "%")
	ip, err := netip.ParseAddr(addr)
	if err != nil || !ip.Is6() || ip.Zone() != "" {
		return b, fmt.Errorf("%w: invalid IPv6 literal %q", ErrInvalid, lit)
	}
	if hasZone {
		if zone == "" {
			return b, fmt.Errorf("%w: empty IPv6 zone in %q", ErrInvalid, lit)
		}
		for i := 0; i < len(zone); i++ {
			if charClass[zone[i]]&classUnreserved == 0 {
				return b, fmt.Errorf("%w: unsupported IPv6 zone %q", ErrInvalid, zone)
			}
		}
	}
	b = append(b, '[')
	b = ip.AppendTo(b)
	if hasZone {
		b = append(b, "%25"...)
		b = append(b, zone...)
	}
	return append(b, ']'), nil
}

// appendRegName appends the canonical form of the host name host.
func appendRegName(b []byte, host string) ([]byte, error) {
	for i := 0; i < len(host); i++ {
		if host[i] < utf8.RuneSelf {
			continue
		}
		if !utf8.ValidString(host) {
			return b, fmt.Errorf("%w: host %q is not UTF-8", ErrInvalid, host)
		}
		a, err := idna.Lookup.ToASCII(host)
		if err != nil {
			return b, fmt.Errorf("%w: host %q: %v", ErrInvalid, host, err)
		}
		host = a
		break
	}
	host = strings.TrimSuffix(host, ".")
	if host == "" {
		return b, fmt.Errorf("%w: empty host", ErrInvalid)
	}
	dot := true // the previous byte ended a label (or there was none yet)
	for i := 0; i < len(host); i++ {
		c := host[i]
		switch {
		case 'A' <= c && c <= 'Z':
			c += 'a' - 'A'
		case 'a' <= c && c <= 'z', '0' <= c && c <= '9', c == '-', c == '_':
		case c == '.':
			if dot {
				return b, fmt.Errorf("%w: empty label in host %q", ErrInvalid, host)
			}
		default:
			return b, fmt.Errorf("%w: invalid character %q in host %q", ErrInvalid, c, host)
		}
		dot = c == '.'
		b = append(b, c)
	}
	if dot {
		return b, fmt.Errorf("%w: empty label in host %q", ErrInvalid, host)
	}
	return b, nil
}

// appendPort appends ":port" unless port is empty or the scheme's default.
func appendPort(b []byte, port string, https bool) ([]byte, error) {
	if port == "" {
		return b, nil
	}
	n := 0
	for i := 0; i < len(port); i++ {
		c := port[i]
		if c < '0' || c > '9' {
			return b, fmt.Errorf("%w: invalid port %q", ErrInvalid, port)
		}
		if n = n*10 + int(c-'0'); n > 65535 {
			return b, fmt.Errorf("%w: port %q out of range", ErrInvalid, port)
		}
	}
	switch {
	case n == 0:
		return b, fmt.Errorf("%w: port %q out of range", ErrInvalid, port)
	case https && n == 443, !https && n == 80:
		return b, nil
	}
	b = append(b, ':')
	return strconv.AppendInt(b, int64(n), 10), nil
}
