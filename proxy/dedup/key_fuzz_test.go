package dedup

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"net/url"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"
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
	keyer := NewKeyer(nil)
	f.Fuzz(func(t *testing.T, raw string) {
		u, err := url.Parse(raw)
		if err != nil {
			return
		}
		got, err := CanonicalURL(u, DefaultIgnoreParams)
		if err != nil {
			if !errors.Is(err, ErrInvalidURL) {
				t.Fatalf("CanonicalURL(%q) error %v does not wrap ErrInvalidURL", raw, err)
			}
			return
		}
		if !strings.HasPrefix(got, "http://") && !strings.HasPrefix(got, "https://") {
			t.Fatalf("CanonicalURL(%q) = %q: bad scheme", raw, got)
		}
		if strings.ContainsAny(got, "#\x00 ") {
			t.Fatalf("CanonicalURL(%q) = %q: fragment or raw space", raw, got)
		}
		if g, err := keyer.CanonicalURL(u); g != got || err != nil {
			t.Fatalf("Keyer.CanonicalURL(%q) = %q, %v; want %q", raw, g, err, got)
		}
		u2, err := url.Parse(got)
		if err != nil {
			t.Fatalf("CanonicalURL(%q) = %q, which does not parse: %v", raw, got, err)
		}
		if u2.Host == "" || u2.Fragment != "" || u2.User != nil || u2.ForceQuery {
			t.Fatalf("CanonicalURL(%q) = %q, parsed as %#v", raw, got, u2)
		}
		again, err := CanonicalURL(u2, DefaultIgnoreParams)
		if err != nil {
			t.Fatalf("CanonicalURL(%q) = %q, which fails: %v", raw, got, err)
		}
		if again != got {
			t.Fatalf("not idempotent: %q -> %q -> %q", raw, got, again)
		}
		// The query still means the same to a form decoder, minus the ignored
		// parameters: same values, in the same order per name.
		if q1, err := url.ParseQuery(u.RawQuery); err == nil {
			for name := range q1 {
				if ignoredDecoded(name, DefaultIgnoreParams) {
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
		// Normalization never moves a '/' between its raw and escaped forms:
		// without dot-segments, the number of escaped slashes is preserved.
		path := u.RawPath
		if path == "" || !unescapesTo(path, u.Path) {
			path = u.EscapedPath()
		}
		path = strings.ToUpper(path)
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

func FuzzKey(f *testing.F) {
	f.Add("GET", "https://e.com/p?b=2&a=1", "Accept", "text/html", "a=1; b=2", "", "u", []byte(nil), uint8(0))
	f.Add("POST", "http://e.com/in.php", "Authorization", "Bearer x", "sid=1;;", "method=a&key=1", "", []byte("method=a&key=1"), uint8(1))
	f.Add("post", "http://e.com/api", "Range", "bytes=0-1", "", "", "", []byte(`{"method":{"b":1,"a":[1,{"y":2,"x":3}]},"key":1}`), uint8(2))
	f.Add("PUT", "http://e.com/api", "If-None-Match", `"x"`, "", "", "", []byte(`{"method":"a","method":"b"}`), uint8(3))
	f.Add("", "http://[::1]:443/%2e%2E", "X-Custom", " v ", "a=1; a=2", "", "", []byte(`{"\ud800":1}`), uint8(4))
	specs := []*KeySpec{
		nil,
		{Body: true, BodyFields: []string{"method", "googlekey", "pageurl"}},
		{Body: true, BodyFields: []string{"method", "a"}, Headers: []string{"X-Custom", "accept-encoding"}},
		{Body: true, ShareCredentials: true, IgnoreParams: []string{"*"}},
		{Headers: []string{}, IgnoreParams: []string{}},
	}
	contentTypes := []string{"", "application/x-www-form-urlencoded", "application/json", "application/ld+json; charset=utf-8", "text/plain"}
	f.Fuzz(func(t *testing.T, method, raw, hname, hval, cookie, auth, user string, body []byte, sel uint8) {
		u, err := url.Parse(raw)
		if err != nil {
			u = &url.URL{Scheme: "http", Host: "e.com", Path: raw}
		}
		h := http.Header{}
		h.Add(hname, hval)
		h.Add("Cookie", cookie)
		h.Add("Authorization", auth)
		if ct := contentTypes[int(sel)%len(contentTypes)]; ct != "" {
			h.Set("Content-Type", ct)
		}
		spec := specs[int(sel/8)%len(specs)]
		k := NewKeyer(spec)
		k1, err1 := k.Key(method, u, h, user, body)
		k2, err2 := k.Key(method, u, h, user, bytes.Clone(body))
		if k1 != k2 || (err1 == nil) != (err2 == nil) {
			t.Fatalf("Key not deterministic: %q, %v vs %q, %v", k1, err1, k2, err2)
		}
		if k3, _ := Key(method, u, h, user, body, spec); k3 != k1 {
			t.Fatalf("Key(spec) = %q, Keyer.Key = %q", k3, k1)
		}
		if err1 != nil {
			if !errors.Is(err1, ErrInvalidURL) {
				t.Fatalf("Key error %v does not wrap ErrInvalidURL", err1)
			}
			return
		}
		if !keyPattern.MatchString(k1) {
			t.Fatalf("Key = %q, bad format", k1)
		}
		// Accept-Encoding never counts.
		h2 := h.Clone()
		h2.Set("Accept-Encoding", hval+"x")
		if k2, _ := k.Key(method, u, h2, user, body); k2 != k1 {
			t.Fatalf("Accept-Encoding changed the key")
		}
		// Credentials always count, unless shared.
		h3 := h.Clone()
		h3.Set("Authorization", auth+"x")
		k3, _ := k.Key(method, u, h3, user, body)
		k4, _ := k.Key(method, u, h, user+"x", body)
		shared := spec != nil && spec.ShareCredentials
		if shared != (k3 == k1) || shared != (k4 == k1) {
			t.Fatalf("credentials: shared=%v, but key with other Authorization equal=%v, other user equal=%v", shared, k3 == k1, k4 == k1)
		}
	})
}

func FuzzCanonJSON(f *testing.F) {
	for _, s := range []string{
		`{}`, `[]`, `1`, `"a"`, `null`, `{"b":1,"a":[true,false,null,{"d":{},"c":[]}]}`,
		` { "a" : "x\"}" , "b\\" : -1.5e+10 } `, `{"a":1,"a":2}`, `{"\u0061":1,"a":2}`,
		`{"\ud83d\ude00":"\ud800"}`, `[[[[[[[[[[{"z":1}]]]]]]]]]]`, `{"a":"\u00e9","é":1}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if !utf8.Valid(data) || !json.Valid(data) {
			return // appendJSONFields hashes such bodies whole
		}
		v := bytes.Trim(data, " \t\r\n")
		got, ok := canonJSON(nil, v, 1)
		if !ok {
			return
		}
		if !json.Valid(got) {
			t.Fatalf("canonJSON(%q) = %q, not valid JSON", data, got)
		}
		var want, have any
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.UseNumber()
		if err := dec.Decode(&want); err != nil {
			t.Fatal(err)
		}
		dec = json.NewDecoder(bytes.NewReader(got))
		dec.UseNumber()
		if err := dec.Decode(&have); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(want, have) {
			t.Fatalf("canonJSON(%q) = %q changes the value: %#v vs %#v", data, got, want, have)
		}
		again, ok := canonJSON(nil, got, 1)
		if !ok || !bytes.Equal(again, got) {
			t.Fatalf("canonJSON not idempotent: %q -> %q -> %q (%v)", data, got, again, ok)
		}
	})
}
