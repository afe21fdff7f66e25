package urlcanon

import "testing"

// TestAppendKeysWhatIsSent: the canonical form names the request the origin
// receives. The proxy writes a request's target with url.URL.RequestURI,
// which uses the client's escaping (RawPath) only when it is a valid
// encoding; otherwise it re-escapes the decoded Path, so that "%2F" goes out
// as '/'. Two requests whose targets go out differently must not share a
// key (one would be served the other's response), and two whose targets go
// out alike should.
func TestAppendKeysWhatIsSent(t *testing.T) {
	for _, in := range []string{
		"http://e.com/a%2Fb|",      // '|' makes RawPath invalid: sent as /a/b%7C
		"http://e.com/a%2Fb%7C",    // valid RawPath: sent as is
		"http://e.com/a%2Fb{x}",    // sent as /a/b%7Bx%7D
		"http://e.com/a%3Bb^/c",    // sent as /a;b%5E/c
		"http://e.com/a%2Fbé",      // sent as /a/b%C3%A9
		"http://e.com/a%2Fb[x]",    // brackets are valid: sent as is
		"http://e.com/%7euser|/x",  // sent as /~user%7C/x
		"http://e.com/a/b|?q=%2F|", // the query goes out verbatim
	} {
		u := mustParse(t, in)
		sent := mustParse(t, u.Scheme+"://"+u.Host+u.RequestURI())
		got, err := canonical(u, nil)
		if err != nil {
			t.Fatalf("Append(%q): %v", in, err)
		}
		want, err := canonical(sent, nil)
		if err != nil {
			t.Fatalf("Append(%q): %v", sent, err)
		}
		if got != want {
			t.Errorf("Append(%q) = %q, but the origin receives %q, whose canonical form is %q", in, got, u.RequestURI(), want)
		}
	}

	// The conflation itself: these two go out as /a/b%7C and /a%2Fb%7C,
	// which an origin tells apart.
	a, _ := canonical(mustParse(t, "http://e.com/a%2Fb|"), nil)
	b, _ := canonical(mustParse(t, "http://e.com/a%2Fb%7C"), nil)
	if a == b {
		t.Errorf("/a%%2Fb| and /a%%2Fb%%7C both canonicalize to %q, but the origin receives /a/b%%7C and /a%%2Fb%%7C", a)
	}
}
