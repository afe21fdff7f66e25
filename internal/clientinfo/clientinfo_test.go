package clientinfo

import (
	"context"
	"net/http"
	"strings"
	"testing"
)

func TestParseUser(t *testing.T) {
	for _, tc := range []struct{ in, account, session string }{
		{"", "", ""},
		{"alice", "alice", ""},
		{"alice-session-abc123", "alice", "abc123"},
		{"alice-session-eu-1", "alice", "eu-1"},
		{"alice-sessid-crawl.7", "alice", "crawl.7"},
		// The id is everything after the first marker.
		{"customer-acme-cc-DE-sessid-s_1-sesstime-10", "customer-acme-cc-DE", "s_1-sesstime-10"},
		{"brd-customer-c1-zone-z1-session-xyz", "brd-customer-c1-zone-z1", "xyz"},
		{"alice-session-x-country-de", "alice", "x-country-de"}, // the session comes last
		{"alice-session-a-session-b", "alice", "a-session-b"},
		{"alice-sessid-a-session-b", "alice", "a-session-b"},
		{"session-abc", "session-abc", ""}, // no account part: not a hint
		{"alice-session", "alice-session", ""},
		{"alice-" + strings.Repeat("s", 64), "alice-" + strings.Repeat("s", 64), ""},
		{"alice-session-" + strings.Repeat("s", 64), "alice", strings.Repeat("s", 64)},
	} {
		u, err := ParseUser(tc.in)
		if err != nil || u.Account != tc.account || u.Session != tc.session {
			t.Errorf("ParseUser(%q) = %+v, %v; want %q, %q", tc.in, u, err, tc.account, tc.session)
		}
	}
}

func TestParseUserRefusesBadSessions(t *testing.T) {
	for _, tc := range []struct{ in, account, reason string }{
		{"alice-session-", "alice", "empty"},
		{"alice-sessid-", "alice", "empty"},
		{"alice-session-bad/id", "alice", `'/'`},
		{"alice-session-a b", "alice", `' '`},
		{"alice-session-é", "alice", "not allowed"},
		{"alice-session-" + strings.Repeat("s", 65), "alice", "more than 64"},
	} {
		u, err := ParseUser(tc.in)
		if err == nil || !strings.Contains(err.Error(), tc.reason) || !strings.Contains(err.Error(), "session") {
			t.Errorf("ParseUser(%q): err = %v, want one saying %s", tc.in, err, tc.reason)
		}
		if u.Account != tc.account || u.Session != "" {
			t.Errorf("ParseUser(%q) = %+v: want the account %q and no session", tc.in, u, tc.account)
		}
	}
}

func TestParseUserLocation(t *testing.T) {
	for _, tc := range []struct{ in, account, country, city, session string }{
		{"alice-country-de", "alice", "DE", "", ""},
		{"alice-country-US-session-abc", "alice", "US", "", "abc"},
		{"alice-country-us-city-newyork-session-eu-1", "alice", "US", "newyork", "eu-1"},
		{"alice-city-Berlin-country-de", "alice", "DE", "berlin", ""},
		{"alice-city-new_york", "alice", "", "new_york", ""},
		{"brd-customer-c1-zone-z1-country-gb-session-xyz", "brd-customer-c1-zone-z1", "GB", "", "xyz"},
		{"country-de", "country-de", "", "", ""}, // no account part: a name
	} {
		u, err := ParseUser(tc.in)
		if err != nil || u.Account != tc.account || u.Country != tc.country || u.City != tc.city || u.Session != tc.session {
			t.Errorf("ParseUser(%q) = %+v, %v; want %q %q %q %q", tc.in, u, err, tc.account, tc.country, tc.city, tc.session)
		}
	}
}

func TestParseUserRefusesBadLocations(t *testing.T) {
	for _, tc := range []struct{ in, reason string }{
		{"alice-country-", "ISO 3166-1"},
		{"alice-country-xx", "ISO 3166-1"},
		{"alice-country-uk", "use GB"},
		{"alice-country-deu-session-a", "ISO 3166-1"},
		{"alice-country-de-zone-z1", "not -zone-"},
		{"alice-country-de-country-fr", "twice"},
		{"alice-city-", "empty"},
		{"alice-city-new.york", "not allowed"},
		{"alice-country", ""}, // no marker: an account name
	} {
		u, err := ParseUser(tc.in)
		if tc.reason == "" {
			if err != nil || u.Account != tc.in {
				t.Errorf("ParseUser(%q) = %+v, %v; want the whole name as the account", tc.in, u, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.reason) {
			t.Errorf("ParseUser(%q): err = %v, want one saying %q", tc.in, err, tc.reason)
		}
		if u.Account != "alice" || u.Country != "" || u.City != "" || u.Session != "" {
			t.Errorf("ParseUser(%q) = %+v: want the account alone", tc.in, u)
		}
	}
}

func TestParseCountry(t *testing.T) {
	for in, want := range map[string]string{"de": "DE", "US": "US", "gB": "GB", "zw": "ZW", "ad": "AD"} {
		if got, err := ParseCountry(in); err != nil || got != want {
			t.Errorf("ParseCountry(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"", "d", "deu", "XX", "EU", "A1", "1a", "dé"} {
		if got, err := ParseCountry(in); err == nil {
			t.Errorf("ParseCountry(%q) = %q, want an error", in, got)
		}
	}
	if n := strings.Count(iso3166, " ") + 1; n != 249 {
		t.Errorf("%d codes in the list, ISO 3166-1 assigns 249", n)
	}
}

func TestValidateSessionID(t *testing.T) {
	for _, id := range []string{"a", "eu-1", "us.2", "crawl_7", "A-b.C_9", strings.Repeat("x", 64)} {
		if err := ValidateSessionID(id); err != nil {
			t.Errorf("ValidateSessionID(%q): %v", id, err)
		}
	}
	for _, id := range []string{"", "a/b", "a b", "a:b", "a\x00", "ü", strings.Repeat("x", 65)} {
		if ValidateSessionID(id) == nil {
			t.Errorf("ValidateSessionID(%q) accepted", id)
		}
	}
}

func TestClientOf(t *testing.T) {
	for _, tc := range []struct{ account, remote, want string }{
		{"acme", "127.0.0.1:5000", "user:acme"},
		{"", "127.0.0.1:5000", "ip:127.0.0.1"},
		{"", "[::ffff:127.0.0.1]:5000", "ip:127.0.0.1"},
		{"", "[::1]:5000", "ip:::1"},
		{"", "203.0.113.7", "ip:203.0.113.7"},
		{"", "pipe", "ip:pipe"},
	} {
		if got := ClientOf(tc.account, tc.remote); got != tc.want {
			t.Errorf("ClientOf(%q, %q) = %q, want %q", tc.account, tc.remote, got, tc.want)
		}
	}
}

func TestForwardedFor(t *testing.T) {
	for _, tc := range []struct {
		h    http.Header
		want string
	}{
		{http.Header{}, ""},
		// The balancer appends: the last entry is the one it saw.
		{http.Header{"X-Forwarded-For": {"198.51.100.9, 203.0.113.7"}}, "203.0.113.7"},
		{http.Header{"X-Forwarded-For": {"198.51.100.9", "203.0.113.7"}}, "203.0.113.7"},
		{http.Header{"X-Forwarded-For": {"203.0.113.7"}, "X-Real-Ip": {"198.51.100.1"}}, "203.0.113.7"},
		{http.Header{"X-Forwarded-For": {"garbage"}, "X-Real-Ip": {"198.51.100.1"}}, "198.51.100.1"},
		{http.Header{"X-Real-Ip": {" 2001:db8::1 "}}, "2001:db8::1"},
		{http.Header{"X-Forwarded-For": {"garbage"}}, ""},
	} {
		if got := ForwardedFor(tc.h); got != tc.want {
			t.Errorf("ForwardedFor(%v) = %q, want %q", tc.h, got, tc.want)
		}
	}
}

func TestContext(t *testing.T) {
	if got := From(context.Background()); got != (Info{}) {
		t.Fatalf("empty context: %+v", got)
	}
	in := Info{User: "u-session-s", Account: "u", Session: "s", Key: "v1:x", Client: "user:u"}
	if got := From(With(context.Background(), in)); got != in {
		t.Fatalf("round trip: %+v", got)
	}
}
