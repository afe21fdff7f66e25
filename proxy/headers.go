package proxy

import (
	"net/http"
	"net/textproto"
	"strings"
)

// hopHeaders are meaningful only for one connection and must not be
// forwarded (RFC 9110 §7.6.1), plus the proxy's own credentials. They are
// spelled canonically: removeHopHeaders deletes them from the map as
// net/http filled it, without canonicalizing each name on every request.
var hopHeaders = []string{
	"Connection",
	"Proxy-Connection", // non-standard, sent by curl and old browsers
	"Keep-Alive",
	"Proxy-Authenticate",
	"Proxy-Authorization",
	"Te",
	"Trailer",
	"Transfer-Encoding",
	"Upgrade",
}

// removeHopHeaders deletes hop-by-hop headers, including those the
// Connection header names. When keepUpgrade is set (a WebSocket handshake)
// Connection: Upgrade and Upgrade survive, as the handshake needs them.
func removeHopHeaders(h http.Header, keepUpgrade bool) {
	for _, v := range h["Connection"] {
		for _, name := range strings.Split(v, ",") {
			name = textproto.TrimString(name)
			if name == "" || keepUpgrade && strings.EqualFold(name, "Upgrade") {
				continue
			}
			h.Del(name)
		}
	}
	for _, name := range hopHeaders {
		if keepUpgrade && (name == "Connection" || name == "Upgrade") {
			continue
		}
		delete(h, name)
	}
	if keepUpgrade {
		h.Set("Connection", "Upgrade")
	}
}

// removeRequestHopHeaders is removeHopHeaders for a request on its way to
// the origin, except that "TE: trailers" goes on (only that member; the
// transfer codings a client accepts are its connection's business).
// Firefox and gRPC clients send it over HTTP/2, where it is the one TE
// value allowed (RFC 9113 §8.2.2), and the gRPC protocol asks it of
// every request (to detect proxies that drop trailers); over HTTP/1.1
// the upstream lists it in Connection as the client did (RFC 9110
// §10.1.4). net/http's ReverseProxy keeps it too.
func removeRequestHopHeaders(h http.Header, keepUpgrade bool) {
	trailers := headerHasToken(h, "Te", "trailers")
	removeHopHeaders(h, keepUpgrade)
	if trailers {
		h["Te"] = []string{"trailers"}
	}
}

// isUpgrade reports a WebSocket handshake, the one protocol switch the
// proxy carries (goproxy splices a 101 for it); it is never deduplicated:
// the response is a live two-way stream. Other upgrades (h2c, SPDY/3.1,
// tcp) go out as plain requests, their Upgrade stripped with the
// hop-by-hop headers: forwarded, an origin's 101 to them left the client
// waiting on a connection nothing spliced.
func isUpgrade(h http.Header) bool {
	return headerHasToken(h, "Connection", "upgrade") && headerHasToken(h, "Upgrade", "websocket")
}

func headerHasToken(h http.Header, name, token string) bool {
	for _, v := range h[name] {
		for _, t := range strings.Split(v, ",") {
			if strings.EqualFold(textproto.TrimString(t), token) {
				return true
			}
		}
	}
	return false
}
