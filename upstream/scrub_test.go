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
