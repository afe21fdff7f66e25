package upstream

import (
	"crypto/tls"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"strings"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
)

// withTEOption readies a request net/http is about to send with "TE:
// trailers" (the one member the proxy passes on) for the protocol its
// connection turns out to speak, which net/http picks only once it has
// the connection (ALPN). Over HTTP/1.1 a sender of TE must list it in
// Connection (RFC 9110 §10.1.4), as the mirror sends it: spelled as the
// HTTP/1.x client listed it, not at all when it did not (its request is
// passed on as it was), and as "TE" for an HTTP/2 client's request, which
// had no Connection field to list it in. Over HTTP/2 the request carries
// no Connection field but the one it had: net/http refuses any but
// keep-alive and close there ("invalid Connection request header").
//
// A GotConn hook sets the field: net/http calls it with the connection,
// on the goroutine of RoundTrip, before it writes the request (HTTP/1.1)
// or encodes its header (HTTP/2), and again for each retry on another
// connection. The request returned has its own header map for it.
func withTEOption(req *http.Request) *http.Request {
	if req.Header["Te"] == nil {
		return req
	}
	opt := "TE"
	if shape := fingerprint.ShapeFrom(req.Context()); shape != nil && shape.PseudoOrder == nil {
		if opt = listedOption(shape.Connection, "te"); opt == "" {
			return req
		}
	}
	base := req.Header["Connection"] // a WebSocket handshake's Upgrade
	h1 := []string{opt}
	if len(base) > 0 {
		h1 = []string{strings.Join(base, ", ") + ", " + opt}
	}
	h := req.Header.Clone()
	ctx := httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
		GotConn: func(info httptrace.GotConnInfo) {
			if negotiatedH2(info.Conn) {
				if base == nil {
					delete(h, "Connection")
				} else {
					h["Connection"] = base
				}
				return
			}
			h["Connection"] = h1
		},
	})
	out := req.WithContext(ctx)
	out.Header = h
	return out
}

// listedOption returns the connection option name as listed in value (a
// Connection field's), "" when it is not there.
func listedOption(value, name string) string {
	for o := range strings.SplitSeq(value, ",") {
		if o = textproto.TrimString(o); strings.EqualFold(o, name) {
			return o
		}
	}
	return ""
}

// negotiatedH2 reports whether c is a TLS connection that chose HTTP/2:
// net/http speaks HTTP/2 on no other (h2c is off in its transports here).
func negotiatedH2(c any) bool {
	tc, ok := c.(interface{ ConnectionState() tls.ConnectionState })
	return ok && tc.ConnectionState().NegotiatedProtocol == "h2"
}
