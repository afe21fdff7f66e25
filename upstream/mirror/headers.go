package mirror

import (
	"net/http"
	"slices"
	"strings"
)

// A field is one header field as it goes on the wire.
type field struct{ name, value string }

// orderFields lays the header out in the client's order. order is the
// client's field names in wire order (repeats included); keepCase writes
// them as spelled there (HTTP/1.1 from an HTTP/1.1 client), else names are
// canonical. A name the client sent k times takes one value per
// occurrence, the last occurrence any values left over. Fields the client
// did not send (added on the way) follow, sorted.
func orderFields(h http.Header, order []string, keepCase bool) []field {
	byKey := byCanonicalKey(h)
	last := make(map[string]int, len(order))
	for i, n := range order {
		last[http.CanonicalHeaderKey(n)] = i
	}
	used := make(map[string]int, len(order))
	out := make([]field, 0, len(byKey)+2)
	for i, n := range order {
		k := http.CanonicalHeaderKey(n)
		vs := byKey[k][used[k]:]
		if len(vs) == 0 {
			continue
		}
		name := k
		if keepCase {
			name = n
		}
		if i == last[k] {
			for _, v := range vs {
				out = append(out, field{name, v})
			}
			used[k] += len(vs)
		} else {
			out = append(out, field{name, vs[0]})
			used[k]++
		}
	}
	rest := make([]string, 0, len(byKey))
	for k := range byKey {
		if _, ok := last[k]; !ok {
			rest = append(rest, k)
		}
	}
	slices.Sort(rest)
	for _, k := range rest {
		for _, v := range byKey[k] {
			out = append(out, field{k, v})
		}
	}
	return out
}

// byCanonicalKey returns h with its keys canonical, values of keys that
// differ only in case merged. A header net/http built is that already, and
// is returned as it is: a copy cost an allocation per field per request.
func byCanonicalKey(h http.Header) http.Header {
	canonical := true
	for k := range h {
		if http.CanonicalHeaderKey(k) != k {
			canonical = false
			break
		}
	}
	if canonical {
		return h
	}
	byKey := make(http.Header, len(h))
	for k, vs := range h {
		c := http.CanonicalHeaderKey(k)
		byKey[c] = append(byKey[c], vs...)
	}
	return byKey
}

// hopHeaders are connection-specific: they mean something for one
// connection only, and HTTP/2 forbids them (RFC 9113 §8.2.2).
var hopHeaders = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Transfer-Encoding", "Upgrade"}

// validFieldValue reports whether v can go in a header field: no CR, LF
// or NUL, which would split or end the header section.
func validFieldValue(v string) bool {
	return !strings.ContainsAny(v, "\r\n\x00")
}
