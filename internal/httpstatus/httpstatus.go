// Package httpstatus is the one way an error says which HTTP status it
// deserves. An error anywhere in onceproxy (a refused target, an exhausted
// session pool, an unknown session id) implements Carrier; the edges that
// answer clients (the proxy port, the SOCKS5 door's reply codes, the admin
// API) read it with Of, through any wrapping. Line is the one way a code
// becomes the Status of a response onceproxy builds, BodyAllowed the one
// rule for which carry a body, CopyHeader the one way an origin's header
// reaches a ResponseWriter, and TrailerAllowed the one rule for which of
// its trailers do.
package httpstatus

import (
	"errors"
	"net/http"
	"strconv"

	"golang.org/x/net/http/httpguts"
)

// Carrier is an error that knows its HTTP status.
type Carrier interface {
	HTTPStatus() int
}

// Of returns the status carried by err or by an error it wraps, and false
// when none does.
func Of(err error) (int, bool) {
	var c Carrier
	if errors.As(err, &c) {
		return c.HTTPStatus(), true
	}
	return 0, false
}

// lines are the Status of each code net/http names, built once: cache
// hits and mirrored responses would otherwise allocate one each.
var lines = func() (t [600]string) {
	for code := range t {
		if text := http.StatusText(code); text != "" {
			t[code] = strconv.Itoa(code) + " " + text
		}
	}
	return t
}()

// Line returns the Status of a response with code, as net/http's
// transport sets it: "200 OK"; "299 " for a code it has no text for.
func Line(code int) string {
	if code >= 0 && code < len(lines) && lines[code] != "" {
		return lines[code]
	}
	return strconv.Itoa(code) + " " + http.StatusText(code)
}

// BodyAllowed reports whether a response with code carries a body (RFC
// 9110 §6.4.1: not a 1xx, 204 or 304).
func BodyAllowed(code int) bool {
	return code >= 200 && code != http.StatusNoContent && code != http.StatusNotModified
}

// CopyHeader copies src, the header of a response from an origin, into
// dst, a ResponseWriter's (the values are shared, not copied), and stops
// net/http from adding a Content-Type that src has none for: its servers
// otherwise sniff the first bytes of the body and add one, which shows the
// proxy to the client and changes how a browser treats the body. A nil
// value is net/http's way to suppress a header it would add; nothing is
// written for it.
func CopyHeader(dst, src http.Header) {
	for k, vs := range src {
		dst[k] = vs
	}
	if _, ok := dst["Content-Type"]; !ok {
		dst["Content-Type"] = nil
	}
}

// TrailerAllowed reports whether an origin's trailer field k may reach a
// client. RFC 9110 §6.5.1 keeps fields that frame, route, authenticate or
// describe the body out of trailers (Content-Length, Host, Content-Encoding
// …); net/http's servers drop them, and so does the proxy, whatever the
// origin sent.
func TrailerAllowed(k string) bool { return httpguts.ValidTrailerHeader(k) }
