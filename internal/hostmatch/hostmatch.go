// Package hostmatch matches host names against the lists operators write
// in the configuration: exact names, or "*.example.com" for any subdomain.
package hostmatch

import (
	"fmt"
	"strings"
)

// Valid checks one pattern: a host name, or "*." followed by one.
func Valid(p string) error {
	if p == "" || strings.ContainsAny(p, "/: \t") || strings.Contains(strings.TrimPrefix(p, "*."), "*") {
		return fmt.Errorf("%q is not a host name or *.domain pattern", p)
	}
	return nil
}

// Any reports whether host matches one of the patterns: an exact name
// (case-insensitive, a trailing dot ignored), or "*.example.com" matching
// any subdomain of example.com but not example.com itself.
func Any(patterns []string, host string) bool {
	host = strings.ToLower(strings.TrimSuffix(host, "."))
	for _, p := range patterns {
		p = strings.ToLower(p)
		if suffix, ok := strings.CutPrefix(p, "*."); ok {
			if strings.HasSuffix(host, "."+suffix) {
				return true
			}
		} else if host == p {
			return true
		}
	}
	return false
}
