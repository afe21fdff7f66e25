package upstream

import (
	"encoding/base64"
	"net/url"
	"strings"
	"testing"
)

// TestScrubHidesEchoedCredentials: a session's password never reaches an
// error or a log line, also when a gateway's refusal echoes the request's
// Proxy-Authorization (user:password in base64), or URL-escaped.
func TestScrubHidesEchoedCredentials(t *testing.T) {
	s := &session{proxyURL: &url.URL{Scheme: "http", Host: "gw.test:8080", User: url.UserPassword("acct-session-1", "p@ss word")}}
	basic := base64.StdEncoding.EncodeToString([]byte("acct-session-1:p@ss word"))
	for _, msg := range []string{
		"407 Proxy Authentication Required: got Proxy-Authorization: Basic " + basic,
		"bad password p@ss word",
		"bad password " + url.QueryEscape("p@ss word"),
	} {
		got := s.scrub(msg)
		if strings.Contains(got, "p@ss") || strings.Contains(got, "p%40ss") || strings.Contains(got, basic) {
			t.Errorf("scrub(%q) = %q", msg, got)
		}
	}
}

// TestScrubHidesUserNameTokens: some providers authenticate with a token
// as the user name and no password (http://TOKEN:@gw). A gateway's
// refusal that quoted it, or the Proxy-Authorization it got, reached the
// session's last_error, the log and the client's 502 in clear: scrub hid
// a password only, and nothing at all without one.
func TestScrubHidesUserNameTokens(t *testing.T) {
	const token = "tok_8f3b2c9d1e"
	s := &session{proxyURL: &url.URL{Scheme: "http", Host: "gw.test:8080", User: url.UserPassword(token, "")}}
	basic := base64.StdEncoding.EncodeToString([]byte(token + ":"))
	for _, msg := range []string{
		"407 Proxy Authentication Required: got Proxy-Authorization: Basic " + basic,
		"unknown user " + token,
	} {
		if got := s.scrub(msg); strings.Contains(got, token) || strings.Contains(got, basic) {
			t.Errorf("scrub(%q) = %q", msg, got)
		}
	}
	// A short account name is no token, and masking it everywhere would
	// garble the gateway's message.
	s = &session{proxyURL: &url.URL{Scheme: "http", Host: "gw.test:8080", User: url.UserPassword("bob", "hunter22")}}
	if got, want := s.scrub("bob: bad password hunter22"), "bob: bad password xxxxx"; got != want {
		t.Errorf("scrub = %q, want %q", got, want)
	}
}
