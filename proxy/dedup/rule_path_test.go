package dedup

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestSharingRuleStaysInsideItsPrefix: a rule that shares responses across
// credentials under "/public/" does not cover a request that leaves the
// prefix by dot-segments. Such a request used to match the rule (its path
// as sent starts with "/public/") and be keyed without credentials under
// the path the origin answers ("/private/me"), so a second user with other
// credentials was served the first one's private page.
func TestSharingRuleStaysInsideItsPrefix(t *testing.T) {
	f := newFixture(t, Config{TTL: time.Minute, Rules: []RuleConfig{{Name: "public", PathPrefix: "/public/", ShareCredentials: true}}},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			// The origin answers the normalized path (as most do) and
			// the caller's identity.
			io.WriteString(w, "page for "+r.Header.Get("Authorization"))
		}))
	for _, path := range []string{"/public/../private/me", "/public/%2e%2e/private/me", "/public/./../private/me"} {
		alice := f.get(path, "Authorization", "Bearer alice")
		bob := f.get(path, "Authorization", "Bearer bob")
		if alice.err != nil || bob.err != nil {
			t.Fatalf("%s: %v %v", path, alice.err, bob.err)
		}
		if strings.Contains(bob.body, "alice") || alice.key == bob.key {
			t.Errorf("%s: bob got %q (%s), keys alice %s bob %s", path, bob.body, bob.xcache, alice.key, bob.key)
		}
	}
	// Inside the prefix the rule holds: one answer for everyone.
	alice := f.get("/public/news", "Authorization", "Bearer alice")
	bob := f.get("/public/news", "Authorization", "Bearer bob")
	if alice.key != bob.key || bob.xcache != CacheHit {
		t.Errorf("inside the prefix: keys %s and %s, bob's answer %s, want one shared key and a HIT", alice.key, bob.key, bob.xcache)
	}
}
