package upstream

import (
	"net/http"
	"strings"

	"github.com/dunglas/httpsfv"
)

// A plain-http request through an HTTP gateway goes in absolute form, and
// the gateway answers it like an origin would: a 502 it makes itself when
// it cannot reach the target looks like the origin's own 502. Gateways say
// which it is in a header: Proxy-Status (RFC 9209) names the error of each
// intermediary, and Squid's X-Squid-Error predates it. Read so, the
// answer is what a 502 to CONNECT is on the https path, a target the
// gateway could not reach (TargetUnreachableError): the request never left
// the gateway, so it may be retried on another session whatever its
// method, and the session is charged only once another session reaches the
// target. Without such a header a 5xx stays the origin's.

// unreachableErrors are the RFC 9209 error types a gateway gives before it
// has sent the request on: name resolution and connection set-up.
var unreachableErrors = map[string]bool{
	"dns_timeout":               true,
	"dns_error":                 true,
	"destination_not_found":     true,
	"destination_unavailable":   true,
	"destination_ip_prohibited": true,
	"destination_ip_unroutable": true,
	"connection_refused":        true,
	"connection_timeout":        true,
	"connection_limit_reached":  true,
}

// squidUnreachable are Squid's error pages for the same failures.
var squidUnreachable = map[string]bool{
	"ERR_CONNECT_FAIL":   true,
	"ERR_DNS_FAIL":       true,
	"ERR_CANNOT_FORWARD": true,
}

// gatewayCouldNotReach reports the reason a gateway's 5xx answer gives for
// not reaching the target, or "" when the answer names no such failure
// (the origin's own 5xx, or a gateway failing in another way).
//
// Only the last member of Proxy-Status is read: members are added by each
// intermediary on the way back, so the last is the gateway's; an earlier
// one is the origin's own infrastructure, which the request reached. A
// header that does not parse names nothing.
func gatewayCouldNotReach(h http.Header) string {
	if tok, ok := gatewayError(h); ok && unreachableErrors[tok] {
		return "Proxy-Status: " + tok
	}
	if v := h.Get("X-Squid-Error"); v != "" {
		code, _, _ := strings.Cut(v, " ")
		if squidUnreachable[code] {
			return "X-Squid-Error: " + v
		}
	}
	return ""
}

// gatewayError is the error the last member of Proxy-Status names, with
// ok true when it names one (see gatewayCouldNotReach): the gateway wrote
// the response itself, for that reason ("http_request_denied", say).
func gatewayError(h http.Header) (tok string, ok bool) {
	v := h.Values("Proxy-Status")
	if len(v) == 0 {
		return "", false
	}
	list, err := httpsfv.UnmarshalList(v)
	if err != nil || len(list) == 0 {
		return "", false
	}
	it, isItem := list[len(list)-1].(httpsfv.Item)
	if !isItem {
		return "", false
	}
	e, has := it.Params.Get("error")
	if !has {
		return "", false
	}
	t, isToken := e.(httpsfv.Token)
	return string(t), isToken
}
