package netguard

import (
	"net/netip"
	"strings"
)

// ParseLiteral parses host as an IP address literal in any notation that
// browsers (the WHATWG URL host parser) or libc's inet_aton accept, and
// returns the address without its zone. It returns false if host is not a
// literal.
//
// IPv4 may be written as 1 to 4 dot-separated numbers, each decimal, octal
// with a leading 0 or hexadecimal with a leading 0x; the last number fills
// the remaining bytes: "127.0.0.1", "2130706433", "0x7f000001",
// "0x7f.0.0.1", "0177.0.0.1", "017700000001", "127.1", "127.0.1",
// "127.000.000.001" and "127.0.0.1." are all 127.0.0.1. A number out of
// range ("256.1.1.1", "4294967296"), a fifth part, an empty part or a digit
// invalid for its base makes the whole host not a literal.
//
// IPv6 may be bracketed ("[::1]"), carry a zone ("fe80::1%eth0") and embed
// an IPv4 address ("::ffff:127.0.0.1"); an IPv4-mapped address is returned
// as such, not unmapped. Brackets around anything but IPv6 ("[127.0.0.1]")
// are not a literal.
//
// Host names, even ones that start like numbers ("1.example", "0x.com"),
// are not literals.
func ParseLiteral(host string) (netip.Addr, bool) {
	if n := len(host); n >= 2 && host[0] == '[' && host[n-1] == ']' {
		return parseIPv6(host[1 : n-1])
	}
	if strings.IndexByte(host, ':') >= 0 {
		return parseIPv6(host)
	}
	return parseIPv4(host)
}

func parseIPv6(s string) (netip.Addr, bool) {
	ip, err := netip.ParseAddr(s)
	if err != nil || !ip.Is6() {
		return netip.Addr{}, false
	}
	return ip.WithZone(""), true
}

// parseIPv4 follows the WHATWG URL Standard's IPv4 parser, which accepts
// what inet_aton accepts minus its trailing-garbage leniency.
func parseIPv4(s string) (netip.Addr, bool) {
	// One trailing dot is the fully qualified form ("127.0.0.1.").
	if n := len(s); n > 1 && s[n-1] == '.' {
		s = s[:n-1]
	}
	var nums [4]uint64
	n := 0
	for {
		part, rest, more := strings.Cut(s, ".")
		if n == len(nums) {
			return netip.Addr{}, false
		}
		v, ok := parseIPv4Number(part)
		if !ok {
			return netip.Addr{}, false
		}
		nums[n] = v
		n++
		if !more {
			break
		}
		s = rest
	}
	// Every number but the last is one byte; the last fills the rest.
	for _, v := range nums[:n-1] {
		if v > 0xff {
			return netip.Addr{}, false
		}
	}
	v := nums[n-1]
	if v >= 1<<(8*(5-n)) {
		return netip.Addr{}, false
	}
	for i, b := range nums[:n-1] {
		v |= b << (8 * (3 - i))
	}
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)}), true
}

// parseIPv4Number parses one part of an IPv4 literal: decimal, octal with a
// leading 0, or hexadecimal with a leading 0x ("0x" alone is 0). Values above
// 1<<32 saturate there, which every caller rejects.
func parseIPv4Number(s string) (uint64, bool) {
	if s == "" {
		return 0, false
	}
	radix := uint64(10)
	switch {
	case len(s) >= 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X'):
		radix, s = 16, s[2:]
	case len(s) >= 2 && s[0] == '0':
		radix, s = 8, s[1:]
	}
	var v uint64
	for i := 0; i < len(s); i++ {
		d := digitValue(s[i])
		if d >= radix {
			return 0, false
		}
		v = min(v*radix+d, 1<<32)
	}
	return v, true
}

// digitValue returns the value of a hexadecimal digit, or 16 if c is not one.
func digitValue(c byte) uint64 {
	switch {
	case '0' <= c && c <= '9':
		return uint64(c - '0')
	case 'a' <= c && c <= 'f':
		return uint64(c - 'a' + 10)
	case 'A' <= c && c <= 'F':
		return uint64(c - 'A' + 10)
	}
	return 16
}

// endsInNumber reports whether a browser would parse host as IPv4 (the
// WHATWG "ends in a number" checker): its last label is all digits or a
// valid IPv4 number such as "0x7f". Such a host that ParseLiteral rejects
// ("256.1.1.1") is an invalid URL for a browser, but a name for the resolver.
func endsInNumber(host string) bool {
	if n := len(host); n > 1 && host[n-1] == '.' {
		host = host[:n-1]
	}
	last := host[strings.LastIndexByte(host, '.')+1:]
	if last == "" {
		return false
	}
	_, ok := parseIPv4Number(last)
	return ok || strings.Trim(last, "0123456789") == ""
}
