package upstream

import (
	"errors"
	"fmt"
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
}

func (e *gatewayStatusError) Error() string {
	if e.Detail == "" {
		return e.Status
	}
	return fmt.Sprintf("%s %s", e.Status, e.Detail)
}
