// Package clientinfo owns what the front door learns about a request's
// client, and the rules it learns it by: how a proxy user name carries an
// account and a session hint, what a session id may look like (the one rule
// for ids, shared with upstream.sessions and the provider API), and who the
// client is for fairness limits. The result travels through the request
// context to the stages behind the front door: the dedup engine keys on the
// account and caps flights per client, the rate limiter counts the client,
// the upstream pool picks a session from the hint. Context values, not
// headers: nothing here can leak to an origin.
//
// # Session hints in a proxy user name
//
// A user name is an account, optionally followed by "-session-ID" or
// "-sessid-ID" (the Bright Data / Oxylabs spellings). The session id is
// everything after the first marker, so it comes last and may itself hold
// '-' and '.':
//
//	alice                      account alice, no session
//	alice-session-eu-1         account alice, session eu-1
//	acme-cc-DE-sessid-crawl.7  account acme-cc-DE, session crawl.7
//
// Other provider-style "-key-value" pairs (country, zone) stay part of the
// account for now; they go before the session marker. A session id that
// breaks ValidateSessionID's rule (an empty one included) is an error,
// never ignored: a client that asked for a session and silently got a
// random one would not know.
package clientinfo

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
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
	// Client names who is asking, for the rate limit and the per-client
	// flight cap (see ClientOf): "user:<account>" when authenticated, else
	// "ip:<address>".
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

// ValidateSessionID is the one rule for session ids, wherever they are
// written: upstream.sessions, the provider API's session list, the
// X-Onceproxy-Session header and proxy user names. An id is 1-64
// characters of letters, digits, '_', '-' and '.': safe in a header, a log
// line, a user name and a URL path segment.
func ValidateSessionID(id string) error {
	if id == "" {
		return errors.New("session id is empty")
	}
	if len(id) > maxSessionID {
		return fmt.Errorf("session id %.16q... is %d bytes long, more than %d", id, len(id), maxSessionID)
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-' || c == '.') {
			return fmt.Errorf("session id %q: %q is not allowed (letters, digits, '_', '-' and '.' only)", id, c)
		}
	}
	return nil
}

// User is what a proxy user name says about its client.
type User struct {
	// Account is the name the user store knows ("alice").
	Account string
	// Session is the sticky session asked for ("eu-1"); "" for none.
	Session string
	// More provider-style parameters (country, session time) will join
	// here as the pool learns to honour them.
}

// sessionMarkers introduce the session id in a user name.
var sessionMarkers = []string{"-session-", "-sessid-"}

// ParseUser splits a proxy user name into its account and session hint
// (see the package doc). A name with a session marker but no usable id
// ("alice-session-", "alice-session-a/b") is an error saying why; the
// returned User still carries the Account, so that a user store can check
// the credentials first and the client learns about its hint only once it
// is known.
func ParseUser(name string) (User, error) {
	at, marker := -1, ""
	for _, m := range sessionMarkers {
		// An account cannot be empty: "session-abc" is a name, not a hint.
		if i := strings.Index(name, m); i > 0 && (at < 0 || i < at) {
			at, marker = i, m
		}
	}
	if at < 0 {
		return User{Account: name}, nil
	}
	u := User{Account: name[:at], Session: name[at+len(marker):]}
	if err := ValidateSessionID(u.Session); err != nil {
		return User{Account: u.Account}, fmt.Errorf("proxy user %q names a bad session after %q: %w", name, marker, err)
	}
	return u, nil
}

// ClientOf names a client for fairness limits: its account when it has
// one, else its IP address. remoteAddr is "host:port" or a bare address;
// IPv4-mapped IPv6 addresses count as the IPv4 address they map.
func ClientOf(account, remoteAddr string) string {
	if account != "" {
		return "user:" + account
	}
	host := remoteAddr
	if h, _, err := net.SplitHostPort(remoteAddr); err == nil {
		host = h
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		return "ip:" + ip.Unmap().WithZone("").String()
	}
	return "ip:" + host
}

// ForwardedFor returns the client address a balancer in front of the
// proxy reported: the last X-Forwarded-For entry (the one the nearest
// balancer appended: earlier entries are whatever the client sent), else
// X-Real-IP; "" when neither holds an IP address. Only for a balancer the
// operator controls: anyone can send these headers.
func ForwardedFor(h http.Header) string {
	if xff := h.Values("X-Forwarded-For"); len(xff) > 0 {
		last := xff[len(xff)-1]
		if i := strings.LastIndexByte(last, ','); i >= 0 {
			last = last[i+1:]
		}
		if ip, err := netip.ParseAddr(strings.TrimSpace(last)); err == nil {
			return ip.String()
		}
	}
	if ip, err := netip.ParseAddr(strings.TrimSpace(h.Get("X-Real-IP"))); err == nil {
		return ip.String()
	}
	return ""
}
