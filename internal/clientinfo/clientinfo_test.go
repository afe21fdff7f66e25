package clientinfo

import (
	"context"
	"testing"
)

func TestParseUser(t *testing.T) {
	for _, tc := range []struct{ in, account, session string }{
		{"", "", ""},
		{"alice", "alice", ""},
		{"alice-session-abc123", "alice", "abc123"},
		{"customer-acme-cc-DE-sessid-s_1-sesstime-10", "customer-acme-cc-DE-sesstime-10", "s_1"},
		{"brd-customer-c1-zone-z1-country-us-session-xyz", "brd-customer-c1-zone-z1-country-us", "xyz"},
		{"alice-session-", "alice-session-", ""},
		{"alice-session-bad.id", "alice-session-bad.id", ""},
		{"session-abc", "session-abc", ""}, // no account part: not a hint
	} {
		a, s := ParseUser(tc.in)
		if a != tc.account || s != tc.session {
			t.Errorf("ParseUser(%q) = %q, %q; want %q, %q", tc.in, a, s, tc.account, tc.session)
		}
	}
}

func TestContext(t *testing.T) {
	if got := From(context.Background()); got != (Info{}) {
		t.Fatalf("empty context: %+v", got)
	}
	in := Info{User: "u-session-s", Account: "u", Session: "s", Key: "v1:x"}
	if got := From(With(context.Background(), in)); got != in {
		t.Fatalf("round trip: %+v", got)
	}
}
