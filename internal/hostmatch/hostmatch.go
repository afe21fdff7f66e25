// Package hostmatch owns the one meaning of a host pattern, wherever the
// configuration takes one (proxy.bypass_hosts, dedup and upstream rules,
// rate_limit.exclude_hosts, upstream.insecure_skip_verify_hosts,
// guard.allow_hosts):
//
//   - "api.example.com" is that name exactly, case-insensitively, a
//     trailing dot ignored ("API.Example.com." matches);
//   - "*.example.com" is every name below example.com, at any depth
//     ("a.example.com", "a.b.example.com"), but not example.com itself;
//   - an IPv4 address ("127.0.0.1") is that address as a host.
//
// Nothing else: no '*' elsewhere, no '?', no character classes, no ports,
// schemes or paths. Valid says why a pattern is not one; Compile turns a
// list into a Set that matches without re-reading the patterns.
package hostmatch

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
)

// Valid checks one pattern and says what is wrong with it.
func Valid(p string) error {
	name, wildcard := strings.CutPrefix(p, "*.")
	switch {
	case p == "":
		return errors.New("empty host pattern")
	case p == "*":
		return errors.New(`"*" is not a host pattern ("*.example.com" is every name below example.com)`)
	case strings.ContainsAny(p, ":/"):
		return fmt.Errorf("%q: want a bare host name, without scheme, port or path", p)
	case !ValidName(name):
		return fmt.Errorf(`%q is not a host name or "*." followed by one (a wildcard is allowed only as a leading "*.", and matches every subdomain)`, p)
	case endsInNumber(name) && (wildcard || !isIPv4(name)):
		return fmt.Errorf("%q is neither a host name nor an IPv4 address", p)
	}
	return nil
}

// ValidName reports whether name is a DNS name as configurations write
// them and clients send them: labels of 1-63 ASCII letters, digits, '-' or
// '_' (the set Go's resolver accepts), at most 253 bytes, an optional
// trailing dot. Internationalized names are written in their ASCII (xn--)
// form. Anything else (spaces, '%', '[', ':', empty labels, non-ASCII
// digits) could be read as an address or a different name by some other
// parser.
func ValidName(name string) bool {
	name = strings.TrimSuffix(name, ".")
	if name == "" || len(name) > 253 {
		return false
	}
	label := 0
	for i := 0; i < len(name); i++ {
		switch c := name[i]; {
		case c == '.':
			if label == 0 {
				return false
			}
			label = 0
		case 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_':
			if label++; label > 63 {
				return false
			}
		default:
			return false
		}
	}
	return label > 0
}

// endsInNumber reports whether the last label of name is a number, which
// makes it an IPv4 address in some notation rather than a name (no
// top-level domain is numeric).
func endsInNumber(name string) bool {
	name = strings.TrimSuffix(name, ".")
	last := name[strings.LastIndexByte(name, '.')+1:]
	if strings.HasPrefix(last, "0x") || strings.HasPrefix(last, "0X") {
		return true
	}
	for i := 0; i < len(last); i++ {
		if last[i] < '0' || last[i] > '9' {
			return false
		}
	}
	return last != ""
}

func isIPv4(name string) bool {
	ip, err := netip.ParseAddr(strings.TrimSuffix(name, "."))
	return err == nil && ip.Is4()
}

// Set is a compiled list of patterns. A nil or empty Set matches nothing.
// It is immutable and safe for concurrent use.
type Set struct {
	exact   map[string]struct{} // "api.example.com", lower-case, no trailing dot
	domains map[string]struct{} // "example.com" for "*.example.com"
}

// Compile checks every pattern and returns the Set of them; an error names
// each bad pattern by its index.
func Compile(patterns []string) (*Set, error) {
	s := &Set{exact: map[string]struct{}{}, domains: map[string]struct{}{}}
	var errs []error
	for i, p := range patterns {
		if err := Valid(p); err != nil {
			errs = append(errs, fmt.Errorf("[%d]: %w", i, err))
			continue
		}
		if name, ok := strings.CutPrefix(p, "*."); ok {
			s.domains[Normalize(name)] = struct{}{}
		} else {
			s.exact[Normalize(p)] = struct{}{}
		}
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return s, nil
}

// Len is the number of distinct patterns in s.
func (s *Set) Len() int {
	if s == nil {
		return 0
	}
	return len(s.exact) + len(s.domains)
}

// Match reports whether host (a name or an IPv4 address, without port)
// matches a pattern of s. It looks each of host's parent domains up once,
// however many patterns s holds.
func (s *Set) Match(host string) bool {
	if s.Len() == 0 {
		return false
	}
	host = Normalize(host)
	if _, ok := s.exact[host]; ok {
		return true
	}
	if len(s.domains) == 0 {
		return false
	}
	// "a.b.example.com" tries "b.example.com", then "example.com", then
	// "com". The label before each dot must not be empty.
	for i := strings.IndexByte(host, '.'); i > 0; {
		rest := host[i+1:]
		if _, ok := s.domains[rest]; ok {
			return true
		}
		j := strings.IndexByte(rest, '.')
		if j <= 0 {
			break
		}
		i += j + 1
	}
	return false
}

// Normalize lower-cases a host and drops one trailing dot: the form in
// which two spellings of one host name compare equal. It allocates only
// when host has upper-case letters.
func Normalize(host string) string {
	return strings.ToLower(strings.TrimSuffix(host, "."))
}
