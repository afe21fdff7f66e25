// Package clientinfo carries what the front door learned about a request's
// client through the request context, to the stages behind it: the dedup
// engine keys on the account, the upstream pool picks a session from the
// hint. Context values, not headers: nothing here can leak to an origin.
package clientinfo

import (
	"context"
	"net"
	"strings"
)

// Info describes the client of one request.
type Info struct {
	// User is the proxy user name exactly as authenticated ("" if none),
	// session hints included ("acme-session-abc").
	User string
	// Account is User without provider-style hints ("acme"): the identity
	// responses are scoped to.
	Account string
	// Session is the sticky session the client asked for ("abc"), from a
	// user-session-ID / user-sessid-ID username or the X-Onceproxy-Session
	// header; "" lets the upstream pool choose.
	Session string
	// Key is the dedup key of the logical request, when it has one: a
	// retried or re-queued request keeps its upstream session.
	Key string
	// Client names who is asking, for fairness limits: "user:<account>"
	// when authenticated, else "ip:<address>".
	Client string
}

type ctxKey struct{}

// With returns ctx carrying info.
func With(ctx context.Context, info Info) context.Context {
	return context.WithValue(ctx, ctxKey{}, info)
}

// From returns the Info in ctx (zero if none).
func From(ctx context.Context) Info {
	info, _ := ctx.Value(ctxKey{}).(Info)
	return info
}

// maxSessionID bounds session ids; providers accept up to ~50 characters.
const maxSessionID = 64

// ParseUser splits a provider-style proxy user name into the account and
// the session hint. It understands "-session-ID" (Bright Data, Bytio) and
// "-sessid-ID" (Oxylabs, Thordata); other "-key-value" pairs (country,
// sesstime, zone) stay part of the account. A malformed session id is
// ignored rather than rejected: the request still goes out, unsticky.
func ParseUser(user string) (account, session string) {
	parts := strings.Split(user, "-")
	kept := parts[:0:0]
	for i := 0; i < len(parts); i++ {
		if (parts[i] == "session" || parts[i] == "sessid") && i > 0 && i+1 < len(parts) {
			if id := parts[i+1]; ValidSessionID(id) {
				session = id
				i++
				continue
			}
		}
		kept = append(kept, parts[i])
	}
	return strings.Join(kept, "-"), session
}

// ValidSessionID reports whether id is 1-64 characters of [A-Za-z0-9_].
func ValidSessionID(id string) bool {
	if id == "" || len(id) > maxSessionID {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// ClientOf names a client for fairness limits: its account when it has
// one, else its IP (from a "host:port" remote address).
func ClientOf(account, remoteAddr string) string {
	if account != "" {
		return "user:" + account
	}
	if host, _, err := net.SplitHostPort(remoteAddr); err == nil {
		return "ip:" + host
	}
	return "ip:" + remoteAddr
}
