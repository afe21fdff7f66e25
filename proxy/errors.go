package proxy

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/httpstatus"
)

// errorKind names a failure for clients (in X-Onceproxy-Error) and logs.
type errorKind string

const (
	kindBadRequest   errorKind = "bad_request"
	kindBadSession   errorKind = "bad_session"
	kindBadCountry   errorKind = "bad_country"
	kindUpstream     errorKind = "upstream_error"
	kindTimeout      errorKind = "upstream_timeout"
	kindTLS          errorKind = "upstream_tls"
	kindUnavailable  errorKind = "unavailable"
	kindInternal     errorKind = "internal_error"
	kindClientGone   errorKind = "client_gone"
	kindAuth         errorKind = "proxy_auth_required"
	kindRateLimited  errorKind = "rate_limited"
	kindTooManyConns errorKind = "too_many_connections"
	kindForbidden    errorKind = "forbidden_target"
	headerProxyError           = "X-Onceproxy-Error"
	// headerCache is dedup's X-Cache (dedup.HeaderCache), which the proxy
	// also sets on the answers it makes itself.
	headerCache = "X-Cache"
)

// classify maps an error from forwarding to the status a client gets. It
// runs only at the edge: inner layers return wrapped errors.
func classify(err error) (int, errorKind) {
	var (
		netErr  net.Error
		certErr *tls.CertificateVerificationError
		unknown x509.UnknownAuthorityError
		host    x509.HostnameError
	)
	if st, ok := httpstatus.Of(err); ok {
		switch {
		case st == http.StatusServiceUnavailable:
			return st, kindUnavailable
		case st == http.StatusForbidden:
			return st, kindForbidden
		case st >= 400 && st < 500:
			return st, kindBadRequest
		}
	}
	switch {
	case errors.Is(err, context.Canceled):
		return http.StatusBadGateway, kindClientGone
	case errors.Is(err, context.DeadlineExceeded),
		errors.As(err, &netErr) && netErr.Timeout():
		return http.StatusGatewayTimeout, kindTimeout
	case errors.As(err, &certErr), errors.As(err, &unknown), errors.As(err, &host):
		return http.StatusBadGateway, kindTLS
	default:
		return http.StatusBadGateway, kindUpstream
	}
}

// cacheLabeled is an error from the dedup stage that knows which X-Cache
// outcome the failed request had; the error response carries it too.
type cacheLabeled interface {
	CacheHeaders() (xcache, key string)
}

// retryLater is an error that knows when the request may succeed: no
// upstream session is free before then (upstream.ExhaustedError), the
// flight slots are full. Its answer says so in Retry-After, which clients'
// backoff (urllib3's Retry, say) honours.
type retryLater interface {
	RetryAfter() time.Duration
}

// failureResponse is errorResponse for an error from forwarding: status by
// classify, plus the X-Cache headers when the error carries them.
func failureResponse(req *http.Request, err error) (*http.Response, int, errorKind) {
	status, kind := classify(err)
	resp := errorResponse(req, status, kind, err.Error())
	var later retryLater
	if errors.As(err, &later) {
		if d := later.RetryAfter(); d > 0 {
			resp.Header.Set("Retry-After", retryAfter(d))
		}
	}
	var cl cacheLabeled
	if errors.As(err, &cl) {
		xcache, key := cl.CacheHeaders()
		resp.Header.Set(headerCache, xcache)
		if key != "" {
			resp.Header.Set("X-Cache-Key", key)
		}
	}
	return resp, status, kind
}

// errorResponse builds the response for a failed request: status, a
// one-line reason in the body and X-Onceproxy-Error, never a dropped
// connection.
func errorResponse(req *http.Request, status int, kind errorKind, reason string) *http.Response {
	reason = strings.ReplaceAll(reason, "\n", " ")
	body := fmt.Sprintf("onceproxy: %d %s: %s\n", status, kind, reason)
	h := make(http.Header)
	h.Set("Content-Type", "text/plain; charset=utf-8")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h.Set("Cache-Control", "no-store")
	h.Set(headerProxyError, string(kind))
	return &http.Response{
		Status:        httpstatus.Line(status),
		StatusCode:    status,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        h,
		Body:          newStringBody(body),
		ContentLength: int64(len(body)),
		Request:       req,
	}
}

type stringBody struct{ *strings.Reader }

func (stringBody) Close() error { return nil }

func newStringBody(s string) stringBody { return stringBody{strings.NewReader(s)} }
