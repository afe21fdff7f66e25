package dedup

import (
	"errors"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/urlcanon"
)

func mustParse(t testing.TB, raw string) *url.URL {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatalf("url.Parse(%q): %v", raw, err)
	}
	return u
}

// TestKeyInvalidURL: a URL without a canonical form has no key and no URL
// key, and the error says why in both vocabularies.
func TestKeyInvalidURL(t *testing.T) {
	k := NewKeyer(nil)
	for _, u := range []*url.URL{
		nil,
		mustParse(t, "ftp://example.com/file"),
		mustParse(t, "/relative/path"),
		mustParse(t, "http:example.com"),
		mustParse(t, "http://example..com/"),
		mustParse(t, "http://example.com:0/"),
		{Scheme: "http", Host: "[::1"},
	} {
		if got, err := k.Key("GET", u, nil, Requester{}, nil); got != "" || !errors.Is(err, ErrInvalidURL) || !errors.Is(err, urlcanon.ErrInvalid) {
			t.Errorf("Key(%v) = %q, %v; want ErrInvalidURL wrapping urlcanon.ErrInvalid", u, got, err)
		}
		if got, err := k.URLKey(u); got != "" || !errors.Is(err, ErrInvalidURL) || !errors.Is(err, urlcanon.ErrInvalid) {
			t.Errorf("URLKey(%v) = %q, %v; want ErrInvalidURL wrapping urlcanon.ErrInvalid", u, got, err)
		}
	}
}

// TestDefaultIgnoreParams: a nil KeySpec.IgnoreParams drops every shipped
// tracking parameter, and only those.
func TestDefaultIgnoreParams(t *testing.T) {
	k := NewKeyer(nil)
	base, err := k.Key("GET", mustParse(t, "https://e.com/p?a=1"), nil, Requester{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range DefaultIgnoreParams {
		name := strings.Replace(p, "*", "source", 1)
		got, err := k.Key("GET", mustParse(t, "https://e.com/p?"+name+"=x&a=1"), nil, Requester{}, nil)
		if err != nil || got != base {
			t.Errorf("%s=x changed the key (%v)", name, err)
		}
	}
	if got, _ := k.Key("GET", mustParse(t, "https://e.com/p?a=1&ref=x"), nil, Requester{}, nil); got == base {
		t.Errorf("ref=x, not a listed parameter, was dropped")
	}
}

var keyPattern = regexp.MustCompile(`^v1:[0-9a-f]{64}$`)

func TestKeyFormat(t *testing.T) {
	keyer := NewKeyer(nil)
	k, err := keyer.Key("GET", mustParse(t, "https://example.com/"), nil, Requester{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !keyPattern.MatchString(k) {
		t.Errorf("Key = %q, want v1: and 64 lower-case hex digits", k)
	}
	uk, err := keyer.URLKey(mustParse(t, "https://example.com/"))
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^u1:[0-9a-f]{64}$`).MatchString(uk) {
		t.Errorf("URLKey = %q, want u1: and 64 lower-case hex digits", uk)
	}
	// URLKey is the SHA-256 of the canonical URL, nothing else.
	if want := "u1:0f115db062b7c0dd030b16878c99dea5c354b49dc37b38eb8846179c7783e9d7"; uk != want {
		t.Errorf("URLKey(https://example.com/) = %q, want %q", uk, want)
	}
}

// req describes one request for the key tests.
type req struct {
	method  string
	url     string
	header  http.Header
	user    string
	country string
	body    string
}

func (r req) key(t *testing.T, spec *KeySpec) string {
	t.Helper()
	method := r.method
	if method == "" {
		method = "GET"
	}
	var body []byte
	if r.body != "" {
		body = []byte(r.body)
	}
	k, err := NewKeyer(spec).Key(method, mustParse(t, r.url), r.header, Requester{Account: r.user, Country: r.country}, body)
	if err != nil {
		t.Fatalf("Key(%+v): %v", r, err)
	}
	if !keyPattern.MatchString(k) {
		t.Fatalf("Key(%+v) = %q, bad format", r, k)
	}
	return k
}

func TestKeyEquality(t *testing.T) {
	const u = "https://example.com/search?q=go"
	form := http.Header{"Content-Type": {"application/x-www-form-urlencoded"}}
	jsonCT := http.Header{"Content-Type": {"application/json"}}
	captcha := &KeySpec{Body: true, BodyFields: []string{"method", "googlekey", "pageurl", "action"}}
	tests := []struct {
		name  string
		a, b  req
		spec  *KeySpec
		equal bool
	}{
		{"query order and tracking", req{url: "https://e.com/p?b=2&a=1&utm_source=x"}, req{url: "https://e.com/p?a=1&b=2"}, nil, true},
		{"host case and default port", req{url: "https://E.com:443/p"}, req{url: "https://e.com/p"}, nil, true},
		{"fragment", req{url: u + "#x"}, req{url: u}, nil, true},
		{"query value differs", req{url: u}, req{url: "https://example.com/search?q=gO"}, nil, false},
		{"path differs", req{url: "https://e.com/a"}, req{url: "https://e.com/A"}, nil, false},
		{"scheme differs", req{url: "https://e.com/"}, req{url: "http://e.com/"}, nil, false},
		{"escaped slash differs", req{url: "https://e.com/a%2Fb"}, req{url: "https://e.com/a/b"}, nil, false},
		{"repeated param order differs", req{url: "https://e.com/?a=1&a=2"}, req{url: "https://e.com/?a=2&a=1"}, nil, false},

		{"method GET vs HEAD", req{method: "GET", url: u}, req{method: "HEAD", url: u}, nil, false},
		{"method case kept", req{method: "GET", url: u}, req{method: "get", url: u}, nil, false},
		{"empty method is GET", req{method: "GET", url: u}, req{method: "", url: u}, nil, true},

		{"authorization differs", req{url: u, header: http.Header{"Authorization": {"Bearer a"}}}, req{url: u, header: http.Header{"Authorization": {"Bearer b"}}}, nil, false},
		{"authorization vs none", req{url: u, header: http.Header{"Authorization": {"Bearer a"}}}, req{url: u}, nil, false},
		{"authorization shared", req{url: u, header: http.Header{"Authorization": {"Bearer a"}}}, req{url: u, header: http.Header{"Authorization": {"Bearer b"}}}, &KeySpec{ShareCredentials: true}, true},
		{"cookie differs", req{url: u, header: http.Header{"Cookie": {"sid=1"}}}, req{url: u, header: http.Header{"Cookie": {"sid=2"}}}, nil, false},
		{"cookie vs none", req{url: u, header: http.Header{"Cookie": {"sid=1"}}}, req{url: u}, nil, false},
		{"cookie order", req{url: u, header: http.Header{"Cookie": {"a=1; b=2; c=3"}}}, req{url: u, header: http.Header{"Cookie": {"c=3;b=2;  a=1"}}}, nil, true},
		{"cookie split over lines", req{url: u, header: http.Header{"Cookie": {"a=1; b=2"}}}, req{url: u, header: http.Header{"Cookie": {"b=2", "a=1"}}}, nil, true},
		{"cookie repeated name order kept", req{url: u, header: http.Header{"Cookie": {"a=1; a=2"}}}, req{url: u, header: http.Header{"Cookie": {"a=2; a=1"}}}, nil, false},
		{"cookie without value", req{url: u, header: http.Header{"Cookie": {"a"}}}, req{url: u, header: http.Header{"Cookie": {"a="}}}, nil, false},
		{"cookie shared", req{url: u, header: http.Header{"Cookie": {"sid=1"}}}, req{url: u, header: http.Header{"Cookie": {"sid=2"}}}, &KeySpec{ShareCredentials: true}, true},
		{"proxy user differs", req{url: u, user: "alice"}, req{url: u, user: "bob"}, nil, false},
		{"proxy user vs none", req{url: u, user: "alice"}, req{url: u}, nil, false},
		{"proxy user shared", req{url: u, user: "alice"}, req{url: u, user: "bob"}, &KeySpec{ShareCredentials: true}, true},
		{"country differs", req{url: u, country: "DE"}, req{url: u, country: "US"}, nil, false},
		{"country vs none", req{url: u, country: "DE"}, req{url: u}, nil, false},
		{"country kept with credentials shared", req{url: u, user: "a", country: "DE"}, req{url: u, user: "b", country: "US"}, &KeySpec{ShareCredentials: true}, false},
		{"country shared", req{url: u, country: "DE"}, req{url: u, country: "US"}, &KeySpec{ShareCountries: true}, true},
		{"country shared, credentials not", req{url: u, user: "a", country: "DE"}, req{url: u, user: "b", country: "DE"}, &KeySpec{ShareCountries: true}, false},
		{"country does not slide into the account", req{url: u, user: "aDE"}, req{url: u, user: "a", country: "DE"}, nil, false},
		{"url userinfo differs", req{url: "https://a:1@e.com/"}, req{url: "https://a:2@e.com/"}, nil, false},
		{"url userinfo vs none", req{url: "https://a:1@e.com/"}, req{url: "https://e.com/"}, nil, false},
		{"url userinfo shared", req{url: "https://a:1@e.com/"}, req{url: "https://e.com/"}, &KeySpec{ShareCredentials: true}, true},
		{"credentials do not slide", req{url: u, header: http.Header{"Authorization": {"x"}}}, req{url: u, user: "x"}, nil, false},
		{"api key header differs", req{url: u, header: http.Header{"X-Api-Key": {"k1"}}}, req{url: u, header: http.Header{"X-Api-Key": {"k2"}}}, nil, false},
		{"api key header vs none", req{url: u, header: http.Header{"X-Api-Key": {"k1"}}}, req{url: u}, nil, false},
		{"api key header same", req{url: u, header: http.Header{"X-Api-Key": {"k1"}}}, req{url: u, header: http.Header{"X-Api-Key": {"k1"}}}, nil, true},
		{"api key header shared", req{url: u, header: http.Header{"X-Api-Key": {"k1"}}}, req{url: u, header: http.Header{"X-Api-Key": {"k2"}}}, &KeySpec{ShareCredentials: true}, true},
		{"auth token header differs", req{url: u, header: http.Header{"X-Auth-Token": {"t1"}}}, req{url: u, header: http.Header{"X-Auth-Token": {"t2"}}}, nil, false},
		{"csrf token header differs", req{url: u, header: http.Header{"X-Csrf-Token": {"t1"}}}, req{url: u, header: http.Header{"X-Csrf-Token": {"t2"}}}, nil, false},
		{"subscription key differs", req{url: u, header: http.Header{"Ocp-Apim-Subscription-Key": {"a"}}}, req{url: u, header: http.Header{"Ocp-Apim-Subscription-Key": {"b"}}}, nil, false},
		{"credential headers do not slide", req{url: u, header: http.Header{"X-Api-Key": {"a"}, "X-Token": {"b"}}}, req{url: u, header: http.Header{"X-Api-Key": {"b"}, "X-Token": {"a"}}}, nil, false},
		{"credential header vs country", req{url: u, header: http.Header{"X-Session": {"DE"}}}, req{url: u, country: "DE"}, nil, false},
		{"ordinary header still ignored", req{url: u, header: http.Header{"X-Request-Id": {"1"}, "Sec-Fetch-Mode": {"cors"}}}, req{url: u, header: http.Header{"X-Request-Id": {"2"}, "Sec-Fetch-Mode": {"navigate"}}}, nil, true},

		{"accept differs", req{url: u, header: http.Header{"Accept": {"text/html"}}}, req{url: u, header: http.Header{"Accept": {"application/json"}}}, nil, false},
		{"accept-language differs", req{url: u, header: http.Header{"Accept-Language": {"en"}}}, req{url: u, header: http.Header{"Accept-Language": {"de"}}}, nil, false},
		{"accept absent vs empty", req{url: u, header: http.Header{"Accept": {""}}}, req{url: u}, nil, false},
		{"accept OWS trimmed", req{url: u, header: http.Header{"Accept": {" text/html\t"}}}, req{url: u, header: http.Header{"Accept": {"text/html"}}}, nil, true},
		{"accept lines joined", req{url: u, header: http.Header{"Accept": {"a", "b"}}}, req{url: u, header: http.Header{"Accept": {"a,b"}}}, nil, true},
		{"accept-encoding ignored", req{url: u, header: http.Header{"Accept-Encoding": {"gzip"}}}, req{url: u, header: http.Header{"Accept-Encoding": {"br"}}}, nil, true},
		{"accept-encoding ignored when listed", req{url: u, header: http.Header{"Accept-Encoding": {"gzip"}}}, req{url: u}, &KeySpec{Headers: []string{"accept-encoding", "Accept"}}, true},
		{"unlisted header ignored", req{url: u, header: http.Header{"User-Agent": {"a"}}}, req{url: u, header: http.Header{"User-Agent": {"b"}}}, nil, true},
		{"listed header canonicalized", req{url: u, header: http.Header{"X-Api-Version": {"1"}}}, req{url: u, header: http.Header{"X-Api-Version": {"2"}}}, &KeySpec{Headers: []string{"x-api-version"}}, false},
		{"empty header list keys no accept", req{url: u, header: http.Header{"Accept": {"a"}}}, req{url: u}, &KeySpec{Headers: []string{}}, true},
		{"header list order irrelevant", req{url: u, header: http.Header{"Accept": {"a"}, "X-A": {"b"}}}, req{url: u, header: http.Header{"Accept": {"a"}, "X-A": {"b"}}}, &KeySpec{Headers: []string{"X-A", "Accept"}}, true},

		{"range splits", req{url: u, header: http.Header{"Range": {"bytes=0-99"}}}, req{url: u}, nil, false},
		{"range differs", req{url: u, header: http.Header{"Range": {"bytes=0-99"}}}, req{url: u, header: http.Header{"Range": {"bytes=0-9"}}}, nil, false},
		{"if-none-match splits", req{url: u, header: http.Header{"If-None-Match": {`"x"`}}}, req{url: u}, nil, false},
		{"if-modified-since splits", req{url: u, header: http.Header{"If-Modified-Since": {"Mon, 02 Jan 2006 15:04:05 GMT"}}}, req{url: u}, nil, false},
		{"if-range splits", req{url: u, header: http.Header{"Range": {"bytes=0-9"}, "If-Range": {`"x"`}}}, req{url: u, header: http.Header{"Range": {"bytes=0-9"}}}, nil, false},
		{"if-match splits", req{url: u, header: http.Header{"If-Match": {`"x"`}}}, req{url: u}, nil, false},
		{"if-unmodified-since splits", req{url: u, header: http.Header{"If-Unmodified-Since": {"x"}}}, req{url: u}, nil, false},
		{"conditional keyed with empty header list", req{url: u, header: http.Header{"Range": {"bytes=0-9"}}}, req{url: u}, &KeySpec{Headers: []string{}}, false},
		{"conditional keyed with shared credentials", req{url: u, header: http.Header{"If-None-Match": {`"x"`}}}, req{url: u}, &KeySpec{ShareCredentials: true}, false},
		{"header does not slide into another", req{url: u, header: http.Header{"Accept": {"x"}}}, req{url: u, header: http.Header{"Accept-Language": {"x"}}}, nil, false},

		{"body ignored without Body", req{method: "POST", url: u, body: "a=1"}, req{method: "POST", url: u, body: "a=2"}, nil, true},
		{"body splits with Body", req{method: "POST", url: u, body: "a=1"}, req{method: "POST", url: u, body: "a=2"}, &KeySpec{Body: true}, false},
		{"body equal with Body", req{method: "POST", url: u, body: "a=1"}, req{method: "POST", url: u, body: "a=1"}, &KeySpec{Body: true}, true},
		{"body vs none", req{method: "POST", url: u, body: "a=1"}, req{method: "POST", url: u}, &KeySpec{Body: true}, false},
		{"body content-type splits", req{method: "POST", url: u, body: "a=1", header: form}, req{method: "POST", url: u, body: "a=1", header: http.Header{"Content-Type": {"text/plain"}}}, &KeySpec{Body: true}, false},
		{"body content-encoding splits", req{method: "POST", url: u, body: "a=1", header: http.Header{"Content-Encoding": {"gzip"}}}, req{method: "POST", url: u, body: "a=1"}, &KeySpec{Body: true}, false},

		{"form fields select", req{method: "POST", url: u, header: form, body: "method=userrecaptcha&googlekey=K&pageurl=P&key=SECRET1"}, req{method: "POST", url: u, header: form, body: "method=userrecaptcha&googlekey=K&pageurl=P&key=SECRET2"}, captcha, true},
		{"form fields order", req{method: "POST", url: u, header: form, body: "pageurl=P&method=userrecaptcha&googlekey=K"}, req{method: "POST", url: u, header: form, body: "method=userrecaptcha&googlekey=K&pageurl=P"}, captcha, true},
		{"form fields escaping", req{method: "POST", url: u, header: form, body: "method=a+b&pageurl=http%3A%2F%2Fx"}, req{method: "POST", url: u, header: form, body: "method=a%20b&pageurl=http://x"}, captcha, true},
		{"form field differs", req{method: "POST", url: u, header: form, body: "method=userrecaptcha&googlekey=K1&key=S"}, req{method: "POST", url: u, header: form, body: "method=userrecaptcha&googlekey=K2&key=S"}, captcha, false},
		{"form field missing vs empty", req{method: "POST", url: u, header: form, body: "method=x&action="}, req{method: "POST", url: u, header: form, body: "method=x"}, captcha, false},
		{"form field repeated", req{method: "POST", url: u, header: form, body: "method=x&method=y"}, req{method: "POST", url: u, header: form, body: "method=x"}, captcha, false},
		{"form field repeated order", req{method: "POST", url: u, header: form, body: "method=x&method=y"}, req{method: "POST", url: u, header: form, body: "method=y&method=x"}, captcha, false},
		{"form unparseable hashes whole body", req{method: "POST", url: u, header: form, body: "method=x&key=%zz1"}, req{method: "POST", url: u, header: form, body: "method=x&key=%zz2"}, captcha, false},
		{"form semicolon hashes whole body", req{method: "POST", url: u, header: form, body: "method=x&key=1;a"}, req{method: "POST", url: u, header: form, body: "method=x&key=2;a"}, captcha, false},
		{"form without selected fields hashes whole body", req{method: "POST", url: u, header: form, body: "key=1"}, req{method: "POST", url: u, header: form, body: "key=2"}, captcha, false},
		{"json without selected fields hashes whole body", req{method: "POST", url: u, header: jsonCT, body: `{"key":1}`}, req{method: "POST", url: u, header: jsonCT, body: `{"key":2}`}, captcha, false},
		{"form needs its content-type", req{method: "POST", url: u, body: "method=x&key=1"}, req{method: "POST", url: u, body: "method=x&key=2"}, captcha, false},
		{"form with content-encoding hashes whole body", req{method: "POST", url: u, header: http.Header{"Content-Type": {"application/x-www-form-urlencoded"}, "Content-Encoding": {"identity"}}, body: "method=x&key=1"}, req{method: "POST", url: u, header: http.Header{"Content-Type": {"application/x-www-form-urlencoded"}, "Content-Encoding": {"identity"}}, body: "method=x&key=2"}, captcha, false},
		{"form content-type parameters", req{method: "POST", url: u, header: http.Header{"Content-Type": {"Application/X-WWW-Form-Urlencoded; charset=utf-8"}}, body: "method=x&key=1"}, req{method: "POST", url: u, header: http.Header{"Content-Type": {"Application/X-WWW-Form-Urlencoded; charset=utf-8"}}, body: "method=x&key=2"}, captcha, true},
		{"fields ignored without Body", req{method: "POST", url: u, header: form, body: "method=x"}, req{method: "POST", url: u, header: form, body: "method=y"}, &KeySpec{BodyFields: []string{"method"}}, true},

		{"json fields select", req{method: "POST", url: u, header: jsonCT, body: `{"method":"userrecaptcha","googlekey":"K","pageurl":"P","key":"SECRET1"}`}, req{method: "POST", url: u, header: jsonCT, body: `{"key":"SECRET2","pageurl":"P","googlekey":"K","method":"userrecaptcha"}`}, captcha, true},
		{"json whitespace", req{method: "POST", url: u, header: jsonCT, body: " {\n\"method\" : \"x\" ,\"key\":1}\n"}, req{method: "POST", url: u, header: jsonCT, body: `{"method":"x","key":2}`}, captcha, true},
		{"json nested key order", req{method: "POST", url: u, header: jsonCT, body: `{"action":{"b":[1, {"d":2,"c":3}],"a":null}}`}, req{method: "POST", url: u, header: jsonCT, body: `{"action":{"a":null,"b":[1,{"c":3,"d":2}]}}`}, captcha, true},
		{"json array order matters", req{method: "POST", url: u, header: jsonCT, body: `{"action":[1,2]}`}, req{method: "POST", url: u, header: jsonCT, body: `{"action":[2,1]}`}, captcha, false},
		{"json field differs", req{method: "POST", url: u, header: jsonCT, body: `{"method":"a"}`}, req{method: "POST", url: u, header: jsonCT, body: `{"method":"b"}`}, captcha, false},
		{"json missing vs null", req{method: "POST", url: u, header: jsonCT, body: `{"method":"a","action":null}`}, req{method: "POST", url: u, header: jsonCT, body: `{"method":"a"}`}, captcha, false},
		{"json string vs number", req{method: "POST", url: u, header: jsonCT, body: `{"method":"1"}`}, req{method: "POST", url: u, header: jsonCT, body: `{"method":1}`}, captcha, false},
		{"json number spelling kept", req{method: "POST", url: u, header: jsonCT, body: `{"method":1}`}, req{method: "POST", url: u, header: jsonCT, body: `{"method":1.0}`}, captcha, false},
		{"json escaped field name", req{method: "POST", url: u, header: jsonCT, body: `{"m\u0065thod":"a","key":1}`}, req{method: "POST", url: u, header: jsonCT, body: `{"method":"a","key":2}`}, captcha, true},
		{"json +json type", req{method: "POST", url: u, header: http.Header{"Content-Type": {"application/vnd.api+json"}}, body: `{"method":"a","key":1}`}, req{method: "POST", url: u, header: http.Header{"Content-Type": {"application/vnd.api+json"}}, body: `{"method":"a","key":2}`}, captcha, true},
		{"json unparseable hashes whole body", req{method: "POST", url: u, header: jsonCT, body: `{"method":"a","key":1`}, req{method: "POST", url: u, header: jsonCT, body: `{"method":"a","key":2`}, captcha, false},
		{"json trailing data hashes whole body", req{method: "POST", url: u, header: jsonCT, body: `{"method":"a"} {"key":1}`}, req{method: "POST", url: u, header: jsonCT, body: `{"method":"a"} {"key":2}`}, captcha, false},
		{"json non-object hashes whole body", req{method: "POST", url: u, header: jsonCT, body: `["method","a",1]`}, req{method: "POST", url: u, header: jsonCT, body: `["method","a",2]`}, captcha, false},
		{"json duplicate name hashes whole body", req{method: "POST", url: u, header: jsonCT, body: `{"method":"a","method":"b"}`}, req{method: "POST", url: u, header: jsonCT, body: `{"method":"b","method":"b"}`}, captcha, false},
		{"json duplicate nested name hashes whole body", req{method: "POST", url: u, header: jsonCT, body: `{"action":{"x":1,"x":2}}`}, req{method: "POST", url: u, header: jsonCT, body: `{"action":{"x":2}}`}, captcha, false},
		{"json too deep hashes whole body", req{method: "POST", url: u, header: jsonCT, body: `{"action":` + strings.Repeat("[", 100) + strings.Repeat("]", 100) + `,"key":1}`}, req{method: "POST", url: u, header: jsonCT, body: `{"action":` + strings.Repeat("[", 100) + strings.Repeat("]", 100) + `,"key":2}`}, captcha, false},
		{"json lone surrogate name hashes whole body", req{method: "POST", url: u, header: jsonCT, body: `{"\ud800":1,"method":"a","key":1}`}, req{method: "POST", url: u, header: jsonCT, body: `{"\ud800":1,"method":"a","key":2}`}, captcha, false},
		{"json invalid utf-8 hashes whole body", req{method: "POST", url: u, header: jsonCT, body: "{\"method\":\"a\",\"action\":{\"\xa2\":0,\"\x9e\":1}}"}, req{method: "POST", url: u, header: jsonCT, body: "{\"method\":\"a\",\"action\":{\"\x9e\":1,\"\xa2\":0}}"}, captcha, false},
		{"json surrogate pair name", req{method: "POST", url: u, header: jsonCT, body: `{"\ud83d\ude00":1,"method":"a","key":1}`}, req{method: "POST", url: u, header: jsonCT, body: `{"\ud83d\ude00":1,"method":"a","key":2}`}, captcha, true},
		{"json not json content-type", req{method: "POST", url: u, header: form, body: `{"method":"a","key":1}`}, req{method: "POST", url: u, header: form, body: `{"method":"a","key":2}`}, captcha, false},
		{"json vs form same fields", req{method: "POST", url: u, header: jsonCT, body: `{"method":"a"}`}, req{method: "POST", url: u, header: form, body: `method=a`}, captcha, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ka, kb := tt.a.key(t, tt.spec), tt.b.key(t, tt.spec)
			if got := ka == kb; got != tt.equal {
				t.Errorf("keys equal = %v, want %v\n a: %+v -> %s\n b: %+v -> %s", got, tt.equal, tt.a, ka, tt.b, kb)
			}
		})
	}
}

func TestKeyJSONFieldsSemantics(t *testing.T) {
	// A field with an escaped name selects the same member as the plain one,
	// and a field selects nothing from nested objects.
	spec := &KeySpec{Body: true, BodyFields: []string{"a", "c"}}
	h := http.Header{"Content-Type": {"application/json"}}
	u := "https://e.com/"
	k1 := req{method: "POST", url: u, header: h, body: `{"c":0,"b":{"a":1}}`}.key(t, spec)
	k2 := req{method: "POST", url: u, header: h, body: `{"c":0,"b":{"a":2}}`}.key(t, spec)
	if k1 != k2 {
		t.Errorf("nested member selected: keys differ")
	}
	k3 := req{method: "POST", url: u, header: h, body: `{"c":0,"a":{"a":2}}`}.key(t, spec)
	if k1 == k3 {
		t.Errorf("missing field and present field share a key")
	}
}

func TestKeyURLKeyShared(t *testing.T) {
	k := NewKeyer(nil)
	a, err := k.URLKey(mustParse(t, "https://E.com/p?b=1&a=2&utm_source=x"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := k.URLKey(mustParse(t, "https://e.com:443/p?a=2&b=1"))
	if err != nil {
		t.Fatal(err)
	}
	if a != b {
		t.Errorf("URLKey differs for variants of one URL: %s vs %s", a, b)
	}
	// URLKey and Key never collide: different prefixes.
	kk, _ := k.Key("GET", mustParse(t, "https://e.com/p?a=2&b=1"), nil, Requester{}, nil)
	if kk[3:] == a[3:] {
		t.Errorf("Key and URLKey share a hash")
	}
}

func TestNewKeyerCopiesSpec(t *testing.T) {
	spec := &KeySpec{Headers: []string{"Accept"}, IgnoreParams: []string{"x"}, Body: true, BodyFields: []string{"f"}}
	k := NewKeyer(spec)
	u := mustParse(t, "https://e.com/?x=1")
	h := http.Header{"Accept": {"a"}, "X-B": {"b"}, "Content-Type": {"application/x-www-form-urlencoded"}}
	before, _ := k.Key("POST", u, h, Requester{}, []byte("f=1&g=2"))
	spec.Headers[0] = "X-B"
	spec.IgnoreParams[0] = "y"
	spec.BodyFields[0] = "g"
	spec.ShareCredentials = true
	after, _ := k.Key("POST", u, h, Requester{}, []byte("f=1&g=2"))
	if before != after {
		t.Errorf("mutating the spec changed the compiled Keyer")
	}
}

func TestKeyerConcurrent(t *testing.T) {
	k := NewKeyer(&KeySpec{Body: true, BodyFields: []string{"a"}})
	u := mustParse(t, "https://e.com/p?b=2&a=1")
	h := http.Header{"Cookie": {"b=1; a=2"}, "Content-Type": {"application/json"}}
	body := []byte(`{"a":{"y":1,"x":2}}`)
	want, err := k.Key("POST", u, h, Requester{Account: "u"}, body)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 100 {
				if got, _ := k.Key("POST", u, h, Requester{Account: "u"}, body); got != want {
					t.Errorf("concurrent Key = %s, want %s", got, want)
					return
				}
			}
		})
	}
	wg.Wait()
}

// TestKeyStable pins key v1: if this changes, every cached entry and every
// fleet lease is orphaned, so bump keyVersion instead.
func TestKeyStable(t *testing.T) {
	h := http.Header{
		"Accept":          {"text/html"},
		"Accept-Language": {"en-US,en;q=0.9"},
		"Cookie":          {"b=2; a=1"},
	}
	got, err := NewKeyer(nil).Key("GET", mustParse(t, "https://Example.com/p?b=2&a=1&utm_source=x"), h, Requester{Account: "alice"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	const want = "v1:82b42dd23e7f8844189066dd0098bdee222a9895ae91df5054be3bdb75ff320c"
	if got != want {
		t.Errorf("Key = %s, want %s", got, want)
	}
}

func BenchmarkKey(b *testing.B) {
	k := NewKeyer(&KeySpec{})
	u, err := url.Parse("https://www.example.com/search/results?q=golang+proxy&page=2&sort=desc&lang=en&utm_source=newsletter")
	if err != nil {
		b.Fatal(err)
	}
	h := http.Header{
		"Accept":          {"text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"},
		"Accept-Language": {"en-US,en;q=0.9"},
		"Accept-Encoding": {"gzip, deflate, br"},
		"Cookie":          {"session=8f14e45fceea167a5a36dedd4bea2543; theme=dark; consent=yes"},
		"User-Agent":      {"Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/124.0 Safari/537.36"},
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := k.Key("GET", u, h, Requester{Account: "scraper-1"}, nil); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkKeyJSONFields(b *testing.B) {
	k := NewKeyer(&KeySpec{Body: true, BodyFields: []string{"method", "googlekey", "pageurl"}})
	u, err := url.Parse("https://api.example.com/in.php")
	if err != nil {
		b.Fatal(err)
	}
	h := http.Header{"Content-Type": {"application/json"}}
	body := []byte(`{"key":"SECRET","method":"userrecaptcha","googlekey":"6Le-wvkSAAAAAPBMRTvw0Q4Muexq9bi0DJwx_mJ-","pageurl":"https://www.google.com/recaptcha/api2/demo","json":1}`)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := k.Key("POST", u, h, Requester{}, body); err != nil {
			b.Fatal(err)
		}
	}
}
