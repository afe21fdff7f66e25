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

// isUpgrade reports whether r asks to switch protocols (a WebSocket
// handshake, in practice). Such requests are never deduplicated: the
// response is a live two-way stream.
func isUpgrade(h http.Header) bool {
	return headerHasToken(h, "Connection", "upgrade") && h.Get("Upgrade") != ""
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
