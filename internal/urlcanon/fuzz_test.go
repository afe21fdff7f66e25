package urlcanon

import (
	"errors"
	"net/url"
	"reflect"
	"strings"
	"testing"
)

// fuzzURLSeeds are URLs that have broken URL normalizers before.
var fuzzURLSeeds = []string{
	"http://example.com",
	"HTTP://EXAMPLE.COM:80/A/./B/../C?b=2&a=1#frag",
	"https://Bücher.example./%7euser/a%2fb?utm_source=x&q=a+b",
	"https://user:pw@[2001:DB8::1]:443/?",
	"http://[fe80::1%25en0]:8080/x",
	"http://example.com:/a//b/../../c/./d/..",
	"http://e.com/%2E%2E/%2e/./a/..%2F../b",
	"http://e.com/a%2Fb c?x=%zz&y=%4%31&&z",
	"http://e.com/a b/é/%c3%a9?q=a b&q=é&=&a=&a",
	"http://e.com/?utm%5Fsource=1&gclid=2&fbclid=3&ref_src=4&_ga=5",
	"http://xn--bcher-kva.example/?a=1;b=2",
	"http://e.com/[]{}|\\^`\"<>",
	"http://e.com/%25%2525%%41",
	"http://e.com/..;/a/.;/b",
	"https://r3---sn-abc.googlevideo.com/videoplayback?expire=1&id=o-A",
	"http://127.0.0.1:00080/",
	"http://e.com/a/b/c/./../../g",
	"http://e.com//..//../a",
	"http://a.b.c.example/%41%42%43/%7E%2D%5F%2E",
	"ftp://e.com/",
	"//e.com/x",
	"http:e.com",
	"http://-x.ü/",
}

func FuzzCanonicalURL(f *testing.F) {
	for _, s := range fuzzURLSeeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		u, err := url.Parse(raw)
		if err != nil {
			return
		}
		got, err := canonical(u, trackingParams)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("Append(%q) error %v does not wrap ErrInvalid", raw, err)
			}
			return
		}
		if !strings.HasPrefix(got, "http://") && !strings.HasPrefix(got, "https://") {
			t.Fatalf("Append(%q) = %q: bad scheme", raw, got)
		}
		if strings.ContainsAny(got, "#\x00 ") {
			t.Fatalf("Append(%q) = %q: fragment or raw space", raw, got)
		}
		u2, err := url.Parse(got)
		if err != nil {
			t.Fatalf("Append(%q) = %q, which does not parse: %v", raw, got, err)
		}
		if u2.Host == "" || u2.Fragment != "" || u2.User != nil || u2.ForceQuery {
			t.Fatalf("Append(%q) = %q, parsed as %#v", raw, got, u2)
		}
		again, err := canonical(u2, trackingParams)
		if err != nil {
			t.Fatalf("Append(%q) = %q, which fails: %v", raw, got, err)
		}
		if again != got {
			t.Fatalf("not idempotent: %q -> %q -> %q", raw, got, again)
		}
		// The canonical form names the request the origin receives: the
		// proxy writes the target with RequestURI.
		if sent, err := url.Parse(u.Scheme + "://" + u.Host + u.RequestURI()); err == nil {
			if want, err := canonical(sent, trackingParams); err == nil && want != got {
				t.Fatalf("Append(%q) = %q, but the origin receives %q: %q", raw, got, u.RequestURI(), want)
			}
		}
		// The query still means the same to a form decoder, minus the ignored
		// parameters: same values, in the same order per name.
		if q1, err := url.ParseQuery(u.RawQuery); err == nil {
			for name := range q1 {
				if ignoredDecoded(name, trackingParams) {
					delete(q1, name)
				}
			}
			q2, err := url.ParseQuery(u2.RawQuery)
			if err != nil {
				t.Fatalf("%q -> %q: query no longer parses: %v", raw, got, err)
			}
			if len(q1) != 0 || len(q2) != 0 {
				if !reflect.DeepEqual(q1, q2) {
					t.Fatalf("%q -> %q: query values changed: %v vs %v", raw, got, q1, q2)
				}
			}
		}
		// Normalization never moves a '/' between its raw and escaped forms
		// in the path the origin receives (EscapedPath): without
		// dot-segments, the number of escaped slashes is preserved.
		path := strings.ToUpper(u.EscapedPath())
		if strings.HasPrefix(path, "/") && !strings.Contains(path, "%2E") && removeDotSegmentsRef(path) == path {
			if n, m := strings.Count(path, "%2F"), strings.Count(u2.EscapedPath(), "%2F"); n != m {
				t.Fatalf("%q -> %q: %d escaped slashes became %d", raw, got, n, m)
			}
		}
	})
}

// ignoredDecoded is ignored, for a decoded name, written independently.
func ignoredDecoded(name string, ignoreParams []string) bool {
	for _, p := range ignoreParams {
		if strings.HasSuffix(p, "*") && strings.HasPrefix(name, p[:len(p)-1]) || name == p {
			return true
		}
	}
	return false
}

func FuzzRemoveDotSegments(f *testing.F) {
	for _, s := range []string{"/", "/a/./b/../c", "/..", "/a//../b", "/./../.", "/a/b/.", "//..//../x", "/.../..a/a..", "/a/b/c/./../../g"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		if !strings.HasPrefix(p, "/") {
			p = "/" + p
		}
		want := removeDotSegmentsRef(p)
		if got := string(removeDotSegments([]byte(p))); got != want {
			t.Fatalf("removeDotSegments(%q) = %q, want %q (RFC 3986 5.2.4)", p, got, want)
		}
	})
}
