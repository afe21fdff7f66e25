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
// Before the session marker, "-country-XX" asks for an exit IP in country
// XX (an ISO 3166-1 alpha-2 code, either case) and "-city-NAME" for one in
// that city; the account is what comes before the first of them:
//
//	alice-country-de                       account alice, country DE
//	alice-country-us-city-newyork-session-7  account alice, US, newyork, session 7
//
// Once a country or city part has started, only those two may follow (each
// once) until the session marker. Other provider-style "-key-value" pairs
// (zone, cc) stay part of the account; they go before the first country or
// city part. A session id, country or city that breaks its rule
// (ValidateSessionID, ParseCountry, ParseCity; an empty one included) is an
// error, never ignored: a client that asked for a session or a country and
// silently got a random one would not know.
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
	// Country is the exit country the client asked for ("DE"), from a
	// user-country-XX user name or the X-Onceproxy-Country header; "" for
	// any. City ("berlin") narrows it, from user-city-NAME.
	Country, City string
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
	// Country ("DE", upper-case) and City ("berlin", lower-case) are the
	// exit location asked for; "" for any.
	Country, City string
}

// sessionMarkers introduce the session id in a user name.
var sessionMarkers = []string{"-session-", "-sessid-"}

// geoMarkers introduce the exit location in a user name.
var geoMarkers = []string{"-country-", "-city-"}

// ErrBadSession and ErrBadLocation are wrapped by ParseUser's errors: a
// session hint, or a country or city, the proxy cannot honour.
var (
	ErrBadSession  = errors.New("bad session hint")
	ErrBadLocation = errors.New("bad exit location")
)

// ParseUser splits a proxy user name into its account, exit location and
// session hint (see the package doc). A name with a hint it cannot honour
// ("alice-session-", "alice-session-a/b", "alice-country-xx") is an error
// saying why; the returned User still carries the Account, so that a user
// store can check the credentials first and the client learns about its
// hint only once it is known.
func ParseUser(name string) (User, error) {
	head, session, marker := name, "", ""
	if at, m := firstMarker(name, sessionMarkers); at > 0 {
		head, session, marker = name[:at], name[at+len(m):], m
	}
	u := User{Account: head}
	if at, _ := firstMarker(head, geoMarkers); at > 0 {
		u.Account = head[:at]
		if err := u.parseGeo(head[at+1:]); err != nil {
			return User{Account: u.Account}, fmt.Errorf("proxy user %q: %w (%w)", name, err, ErrBadLocation)
		}
	}
	if marker == "" {
		return u, nil
	}
	if err := ValidateSessionID(session); err != nil {
		return User{Account: u.Account}, fmt.Errorf("proxy user %q names a bad session after %q: %w (%w)", name, marker, err, ErrBadSession)
	}
	u.Session = session
	return u, nil
}

// firstMarker returns where the earliest of markers starts in name, and
// which one; -1 when none does. An account cannot be empty: a marker at
// the very start ("session-abc") is part of a name, not a hint.
func firstMarker(name string, markers []string) (int, string) {
	at, marker := -1, ""
	for _, m := range markers {
		if i := strings.Index(name, m); i > 0 && (at < 0 || i < at) {
			at, marker = i, m
		}
	}
	return at, marker
}

// parseGeo reads "country-XX", "city-NAME" or both, '-'-separated, into u.
func (u *User) parseGeo(s string) error {
	parts := strings.Split(s, "-")
	for i := 0; i < len(parts); i += 2 {
		key, val := parts[i], ""
		if i+1 < len(parts) {
			val = parts[i+1]
		}
		var err error
		switch {
		case key == "country" && u.Country == "":
			u.Country, err = ParseCountry(val)
		case key == "city" && u.City == "":
			u.City, err = ParseCity(val)
		case key == "country" || key == "city":
			return fmt.Errorf("-%s- is given twice", key)
		default:
			return fmt.Errorf("after -country- or -city-, only -country-XX, -city-NAME and last -session-ID may follow, not -%s-", key)
		}
		if err != nil {
			return err
		}
	}
	return nil
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

// forwardedFields are where a balancer tells the client's address: the
// two ForwardedFor reads, and RFC 7239's Forwarded. Canonically spelled.
var forwardedFields = []string{"X-Forwarded-For", "X-Real-Ip", "Forwarded"}

// DropForwarded removes from h what a trusted balancer said about the
// client, once ForwardedFor has read it: it was said to the proxy, and
// passed on it would tell every origin the client's own address.
func DropForwarded(h http.Header) {
	for _, name := range forwardedFields {
		delete(h, name)
	}
}
