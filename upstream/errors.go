package upstream

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"
)

// DialError reports that a connection toward the origin could not be
// established: the request never reached the origin, so it is safe to retry
// and the failure says nothing about the origin's answer.
type DialError struct {
	Op  string
	Err error
}

func (e *DialError) Error() string { return e.Op + ": " + e.Err.Error() }
func (e *DialError) Unwrap() error { return e.Err }

// ErrExhausted matches (errors.Is) every error that means "no upstream
// session could take this request".
var ErrExhausted = errors.New("upstream: no session available")

// ExhaustedError is returned when no session can take a request: every
// session (of the country asked for) is cooling down, there is none in
// that country, or there are none yet (the provider API has not
// answered). The proxy answers it with 503 and the message.
type ExhaustedError struct {
	// Sessions is how many sessions the pool has (all of them cooling).
	Sessions int
	// NextReady is when the first one comes back; 0 when unknown.
	NextReady time.Duration
	// Reason is the whole explanation, e.g. "all 3 upstream sessions are
	// cooling down (next ready in 41s)".
	Reason string
	// Cause is the failure that put the last session into cooldown, when
	// this request saw it happen.
	Cause error
	// Country is the exit country the request asked for ("" for any).
	Country string
}

func (e *ExhaustedError) Error() string {
	if e.Cause != nil {
		return e.Reason + "; last failure: " + e.Cause.Error()
	}
	return e.Reason
}

func (e *ExhaustedError) Unwrap() error { return e.Cause }

// HTTPStatus is 503: the condition is temporary.
func (e *ExhaustedError) HTTPStatus() int { return http.StatusServiceUnavailable }

// RetryAfter is NextReady: when a session is free again (0: unknown).
func (e *ExhaustedError) RetryAfter() time.Duration { return e.NextReady }

// Is makes errors.Is(err, ErrExhausted) true.
func (e *ExhaustedError) Is(target error) bool { return target == ErrExhausted }

// StatusError is an error of the admin operations (Rotate) that knows the
// HTTP status it maps to: 404 for an unknown session, 409 for a session the
// provider API cannot rotate, 502 when the provider API failed.
type StatusError struct {
	Status int
	Err    error
}

func (e *StatusError) Error() string   { return e.Err.Error() }
func (e *StatusError) Unwrap() error   { return e.Err }
func (e *StatusError) HTTPStatus() int { return e.Status }

// gatewayStatusError is a non-200 answer of an HTTP gateway to CONNECT. Its
// status decides the mark: 429 is the provider rate-limiting this session,
// anything else a connection failure.
type gatewayStatusError struct {
	StatusCode int
	Status     string // "407 Proxy Authentication Required"
	Detail     string // first line of the body, if any
	// RetryAfter is the answer's Retry-After (a 429's): the session
	// cools for it, as after the same answer to a plain-http request.
	RetryAfter time.Duration
}

// gatewayAnswer is the error a gateway's own answer makes, to CONNECT or
// to a plain-http request: its status, its Retry-After, and the first line
// of its body, which often says why (bad credentials, host refused); the
// body is read (256 bytes at most) and closed.
func gatewayAnswer(resp *http.Response) *gatewayStatusError {
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 256))
	resp.Body.Close()
	return &gatewayStatusError{StatusCode: resp.StatusCode, Status: resp.Status, Detail: trimLine(msg),
		RetryAfter: retryAfter(resp.Header.Get("Retry-After"), time.Now())}
}

func (e *gatewayStatusError) Error() string {
	if e.Detail == "" {
		return e.Status
	}
	return fmt.Sprintf("%s %s", e.Status, e.Detail)
}

// TargetUnreachableError is a gateway's answer that it could not reach the
// target, or will not: CONNECT answered 502, 503 or 504, or 403 (the
// provider's policy refuses the target), or a SOCKS5 reply "host
// unreachable", "network unreachable", "connection refused", "TTL
// expired" or "connection not allowed by ruleset". It is the one answer a
// gateway gives both when the origin is down (or refused) and when the
// session's exit cannot reach it, so it is not charged to the session on
// sight (see targetMisses in pool.go). Status is what the client is
// answered: 504 when the gateway timed out, else 502.
type TargetUnreachableError struct {
	Target string
	Status int
	Err    error // the gateway's answer
	// uncharged: read off a plain-http answer's headers (proxystatus.go),
	// which the origin's own load balancer may have written and the
	// gateway passed on. It is retried on another session like any
	// miss, but never charged to the session that got it.
	uncharged bool
}

func (e *TargetUnreachableError) Error() string {
	return "target " + e.Target + " unreachable through the upstream gateway: " + e.Err.Error()
}

func (e *TargetUnreachableError) Unwrap() error { return e.Err }

// HTTPStatus is 502, or 504 when the gateway timed out reaching the target.
func (e *TargetUnreachableError) HTTPStatus() int { return e.Status }

// Timeout makes a 504 a timeout for the edges that map net.Error timeouts
// to 504 Gateway Timeout.
func (e *TargetUnreachableError) Timeout() bool { return e.Status == http.StatusGatewayTimeout }

// Temporary is part of net.Error; deprecated there, always false.
func (e *TargetUnreachableError) Temporary() bool { return false }

// targetStatusOfConnect maps a gateway's CONNECT status to the status of a
// TargetUnreachableError, 0 when the status does not say the target was
// unreachable.
//
// A 403 is how providers refuse a target by policy (a domain they do not
// serve, a closed port), through every session alike: charged to each
// session it was tried on, one request for such a target benched them
// for minutes at every site. Credentials refused are a 407.
func targetStatusOfConnect(code int) int {
	switch code {
	case http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusForbidden:
		return http.StatusBadGateway
	case http.StatusGatewayTimeout:
		return http.StatusGatewayTimeout
	}
	return 0
}
