package proxy

import (
	"context"
	"encoding/base64"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/proxy/ratelimit"
)

// The gate is what every request and tunnel passes before anything leaves
// the proxy: who the client is (407 without valid credentials), whether it
// is over its rate (429), and whether the target may be reached at all
// (403 for private and loopback targets).

// basicCredentials parses a Basic Proxy-Authorization header.
func basicCredentials(h http.Header) (user, password string, ok bool) {
	scheme, cred, found := strings.Cut(h.Get("Proxy-Authorization"), " ")
	if !found || !strings.EqualFold(scheme, "Basic") {
		return "", "", false
	}
	raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(cred))
	if err != nil {
		return "", "", false
	}
	user, password, ok = strings.Cut(string(raw), ":")
	return user, password, ok
}

// authenticate returns the proxy user of req (a CONNECT or a plain
// request), or the refusal to answer it with when a user store is
// configured: a 407 challenge for missing or wrong credentials, a 429
// for a client past auth.max_failures_per_minute.
func (s *Server) authenticate(req *http.Request) (user string, refusal *http.Response) {
	if s.users == nil {
		return proxyUser(req.Header), nil
	}
	if user, password, found := basicCredentials(req.Header); found {
		client := clientinfo.ClientOf("", s.clientAddr(req.RemoteAddr, req.Header))
		ok, wait := s.users.Verify(client, user, password)
		if ok {
			return user, nil
		}
		if wait > 0 {
			s.metrics.AuthFailed()
			resp := errorResponse(req, http.StatusTooManyRequests, kindRateLimited,
				fmt.Sprintf("too many failed logins from this client; new credentials are not checked for %ss (auth.max_failures_per_minute)", retryAfter(wait)))
			resp.Header.Set("Retry-After", retryAfter(wait))
			return "", resp
		}
	}
	s.metrics.AuthFailed()
	return "", s.challenge(req, "proxy credentials required (Proxy-Authorization: Basic)")
}

// challenge is the 407 that makes browsers (which never send credentials
// unasked) retry with them. charset="UTF-8" (RFC 7617) asks for names and
// passwords in UTF-8, the encoding they are checked in; without it a
// client may send Latin-1.
func (s *Server) challenge(req *http.Request, reason string) *http.Response {
	resp := errorResponse(req, http.StatusProxyAuthRequired, kindAuth, reason)
	resp.Header.Set("Proxy-Authenticate", `Basic realm="`+s.realm+`", charset="UTF-8"`)
	return resp
}

// limit applies the client rate limit to client (clientinfo.Info.Client,
// from identify); nil means the request may go on.
func (s *Server) limit(ctx context.Context, req *http.Request, client, host string) *http.Response {
	d, ok := s.allow(ctx, client, host)
	if ok {
		return nil
	}
	refusal := rateLimitedError{d}
	if d.Unavailable {
		resp := errorResponse(req, refusal.HTTPStatus(), kindUnavailable, refusal.Error())
		resp.Header.Set("Retry-After", retryAfter(d.RetryAfter))
		return resp
	}
	resp := errorResponse(req, refusal.HTTPStatus(), kindRateLimited, refusal.Error())
	resp.Header.Set("Retry-After", retryAfter(d.RetryAfter))
	resp.Header.Set("X-RateLimit-Limit", strconv.Itoa(d.Limit))
	resp.Header.Set("X-RateLimit-Remaining", "0")
	return resp
}

// allow takes one request of client's to host from the rate limit; ok is
// true when it may go on, else d says why not.
func (s *Server) allow(ctx context.Context, client, host string) (d ratelimit.Decision, ok bool) {
	if !s.limiter.Enabled() {
		return d, true
	}
	d = s.limiter.Allow(ctx, client, host)
	if !d.Allowed && !d.Unavailable {
		s.metrics.RateLimited()
	}
	return d, d.Allowed
}

// rateLimitedError is the rate limit's refusal, one wording for both
// doors: the answer's status and reason on the HTTP port, a policy's "no"
// (reply 0x02) for a blind SOCKS5 tunnel.
type rateLimitedError struct{ d ratelimit.Decision }

func (e rateLimitedError) Error() string {
	if e.d.Unavailable {
		return "rate limiter unavailable and rate_limit.fail_closed is set"
	}
	return fmt.Sprintf("rate limit of %d requests per window reached for this client; retry in %ss", e.d.Limit, retryAfter(e.d.RetryAfter))
}

func (e rateLimitedError) HTTPStatus() int {
	if e.d.Unavailable {
		return http.StatusServiceUnavailable
	}
	return http.StatusTooManyRequests
}

// retryAfter is a Retry-After value in whole seconds, at least 1.
func retryAfter(d time.Duration) string {
	return strconv.Itoa(max(int((d+time.Second-1)/time.Second), 1))
}

// guardHost applies the SSRF guard to a target host before anything is
// dialled or looked up: the one early check of every door and path. It
// returns the context to dial with (see TargetGuard).
func (s *Server) guardHost(ctx context.Context, host string) (context.Context, error) {
	if s.guard == nil {
		return ctx, nil
	}
	return s.guard.CheckHostContext(ctx, host)
}

// checkTarget is guardHost for a request or CONNECT: the context to dial
// with, or a 403 response.
func (s *Server) checkTarget(ctx context.Context, req *http.Request, host string) (context.Context, *http.Response) {
	ctx, err := s.guardHost(ctx, host)
	if err != nil {
		return ctx, s.refused(req, err)
	}
	return ctx, nil
}

// refused answers a target the guard (at the front door or at dial time)
// refused: 403 with the guard's reason.
func (s *Server) refused(req *http.Request, err error) *http.Response {
	s.metrics.SSRFRefused()
	return errorResponse(req, http.StatusForbidden, kindForbidden, err.Error())
}
