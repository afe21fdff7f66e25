package dedup

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"mime"
	"net/http"
	"net/textproto"
	"net/url"
	"slices"
	"strings"
	"sync"

	"github.com/seed-a3c387e8/onceproxy/internal/jsoncanon"
	"github.com/seed-a3c387e8/onceproxy/internal/urlcanon"
)

// keyVersion tags every key. Bump it whenever the bytes fed to the hash change,
// so that keys of different versions can never collide in a shared store.
const keyVersion = "v1"

// DefaultHeaders are the request headers keyed when [KeySpec.Headers] is nil.
var DefaultHeaders = []string{"Accept", "Accept-Language"}

// DefaultIgnoreParams is the shipped list of tracking query parameters. They
// only tell analytics where a click came from; origins serve the same content
// with or without them. An entry ending in '*' is a prefix match.
var DefaultIgnoreParams = []string{
	"utm_*",   // Google Analytics campaign tags: utm_source, utm_medium, utm_campaign, utm_term, utm_content, utm_id, ...
	"gclid",   // Google Ads click ID
	"dclid",   // Google Display & Video 360 (DoubleClick) click ID
	"gbraid",  // Google Ads click ID for iOS app campaigns
	"wbraid",  // Google Ads web-to-app click ID
	"fbclid",  // Meta (Facebook, Instagram) click ID
	"msclkid", // Microsoft Advertising click ID
	"mc_cid",  // Mailchimp campaign ID
	"mc_eid",  // Mailchimp subscriber ID
	"_ga",     // Google Analytics cross-domain linker
	"_gl",     // Google tag (gtag.js) linker
	"yclid",   // Yandex Direct click ID
	"igshid",  // Instagram share ID
	"ref_src", // X (Twitter) referral source
}

// ErrInvalidURL is wrapped by every error from [Keyer.Key] and
// [Keyer.URLKey]: the URL is not an absolute http or https URL with a valid
// host (the error wraps [urlcanon.ErrInvalid] too, with the reason). Such a
// request cannot be keyed, so it must not be deduplicated.
var ErrInvalidURL = errors.New("dedup: url cannot be keyed")

// conditionalHeaders are always keyed when present, whatever the rule says:
// a 206 or a 304 must never answer a plain request, nor a plain 200 a
// conditional or partial one. The order is part of key v1.
var conditionalHeaders = [...]string{
	"Range",
	"If-Range",
	"If-Match",
	"If-None-Match",
	"If-Modified-Since",
	"If-Unmodified-Since",
}

// KeySpec says what, besides the method and the canonical URL, distinguishes
// two requests. A rule builds it once and compiles it with [NewKeyer].
type KeySpec struct {
	// Headers are request header names whose values select a different
	// response. Names are canonicalized with [textproto.CanonicalMIMEHeaderKey].
	// Accept-Encoding is never keyed, even if listed: the proxy re-encodes
	// responses for each client. Headers listed here are keyed even when
	// ShareCredentials is set. If nil, [DefaultHeaders] (Accept and
	// Accept-Language) is used; an empty non-nil slice keys no header.
	Headers []string

	// IgnoreParams are query parameter names dropped before keying; an entry
	// ending in '*' is a prefix match ("utm_*"). Matching is case-sensitive on
	// the decoded name ('+' decodes to a space, as in forms). If nil,
	// [DefaultIgnoreParams] is used; an empty non-nil slice drops nothing.
	IgnoreParams []string

	// ShareCredentials, when true, leaves Authorization, Cookie, the
	// headers named like credentials, URL userinfo and the proxy user out
	// of the key, so that clients with
	// different credentials share responses. Only for origins whose responses
	// do not depend on who asks.
	ShareCredentials bool

	// ShareCountries, when true, leaves the exit country and city the
	// client asked for out of the key, so that clients asking from
	// different countries share responses. Only for origins that serve
	// every country the same content.
	ShareCountries bool

	// Body, when true, puts the request body into the key, together with its
	// Content-Type and Content-Encoding. Set it for the methods a rule opts in
	// (POST, say); when false, the body is ignored.
	Body bool

	// BodyFields, when non-empty (and Body is true), keys only on these fields
	// of an application/x-www-form-urlencoded body or of a top-level JSON object
	// (application/json or any +json type), as the Content-Type header says.
	// When the body is neither, does not parse, has a Content-Encoding, has
	// none of the fields, or is ambiguous (a JSON object with a repeated
	// name), the whole body is hashed instead: information is never dropped
	// silently.
	BodyFields []string
}

// Requester is who asks, as far as the key goes: the proxy account its
// responses are scoped to (unless ShareCredentials) and the exit country
// and city it asked for (unless ShareCountries), "" for none.
type Requester struct {
	Account, Country, City string
}

// A Keyer is a compiled [KeySpec]. It is immutable and safe for concurrent
// use; build one per rule with [NewKeyer] and reuse it for every request.
type Keyer struct {
	headers          []string // canonical, sorted, unique, without Accept-Encoding
	ignoreParams     []string
	shareCredentials bool
	shareCountries   bool
	body             bool
	bodyFields       []string // sorted, unique; nil unless body
}

// NewKeyer compiles spec. A nil spec is the zero KeySpec: default headers,
// default ignored parameters, credentials and body not shared / not keyed.
// Later changes to spec do not affect the returned Keyer.
func NewKeyer(spec *KeySpec) *Keyer {
	if spec == nil {
		spec = &KeySpec{}
	}
	k := &Keyer{
		shareCredentials: spec.ShareCredentials,
		shareCountries:   spec.ShareCountries,
		body:             spec.Body,
	}

	headers := spec.Headers
	if headers == nil {
		headers = DefaultHeaders
	}
	k.headers = make([]string, 0, len(headers))
	for _, name := range headers {
		name = textproto.CanonicalMIMEHeaderKey(strings.TrimSpace(name))
		if name == "" || name == "Accept-Encoding" {
			continue
		}
		k.headers = append(k.headers, name)
	}
	slices.Sort(k.headers)
	k.headers = slices.Compact(k.headers)

	if spec.IgnoreParams == nil {
		k.ignoreParams = slices.Clone(DefaultIgnoreParams)
	} else {
		k.ignoreParams = slices.Clone(spec.IgnoreParams)
	}

	if spec.Body && len(spec.BodyFields) > 0 {
		k.bodyFields = slices.Clone(spec.BodyFields)
		slices.Sort(k.bodyFields)
		k.bodyFields = slices.Compact(k.bodyFields)
	}
	return k
}

// URLKey returns "u1:" followed by the lower-case hex SHA-256 of the
// canonical URL of u (see [urlcanon.Append]), with the Keyer's ignored
// parameters. All variants of one URL (methods, headers, credentials,
// bodies) share it, so that an operator can invalidate every variant of a
// URL. Its errors are those of [Keyer.Key] for u.
func (k *Keyer) URLKey(u *url.URL) (string, error) {
	kb := getKeyBuf()
	defer kb.put()
	b, err := k.canonicalURL(kb.url[:0], u)
	kb.url = b
	if err != nil {
		return "", err
	}
	return hexKey("u1:", sha256.Sum256(b)), nil
}

// keyBuf holds what a key hashes: the canonical URL, and everything. It
// comes from a pool rather than the stack. Keys are made for every
// request, and on HTTP/2 every request runs on a fresh goroutine, whose
// first stack the 1.3 KiB of arrays Key used to declare overflowed: the
// runtime then copied the whole stack, 4% of the proxy's CPU on unique
// HTTP/2 misses (pprof of BenchmarkVsPlainMITM's load).
type keyBuf struct{ url, all []byte }

var keyBufs = sync.Pool{New: func() any { return &keyBuf{url: make([]byte, 0, 256), all: make([]byte, 0, 1024)} }}

// maxPooledKeyBuf keeps a buffer that a long URL or many body fields grew
// out of the pool.
const maxPooledKeyBuf = 16 << 10

func getKeyBuf() *keyBuf { return keyBufs.Get().(*keyBuf) }

func (kb *keyBuf) put() {
	if cap(kb.url) <= maxPooledKeyBuf && cap(kb.all) <= maxPooledKeyBuf {
		keyBufs.Put(kb)
	}
}

// canonicalURL appends the canonical form of u, without the Keyer's ignored
// parameters, or returns an error wrapping ErrInvalidURL.
func (k *Keyer) canonicalURL(b []byte, u *url.URL) ([]byte, error) {
	b, err := urlcanon.Append(b, u, k.ignoreParams)
	if err != nil {
		return b, fmt.Errorf("%w: %w", ErrInvalidURL, err)
	}
	return b, nil
}

// Key returns the request key: "v1:" followed by 64 lower-case hex digits of a
// SHA-256 over these components, each length-prefixed or tagged so that no
// two different sequences encode alike:
//
//   - the version tag "v1";
//   - the method, exactly as sent (methods are case-sensitive, RFC 9110
//     section 9.1); an empty method means GET, as in net/http;
//   - the canonical URL (see [urlcanon.Append]), with the Keyer's ignored
//     parameters;
//   - each keyed header, in sorted order: its name, whether it is present, and
//     its values trimmed of optional whitespace and joined with ",";
//   - Range, If-Range, If-Match, If-None-Match, If-Modified-Since and
//     If-Unmodified-Since, the same way, whatever the spec says;
//   - unless ShareCredentials: the Authorization values; the cookies (from all
//     Cookie headers, sorted stably by name, so their order does not matter);
//     the URL userinfo (net/http clients send it as Authorization); and
//     who.Account, the authenticated proxy account ("" for none); and, after
//     the body, only when the request has any, the headers named like
//     credentials (X-Api-Key, X-Auth-Token, X-Csrf-Token: see
//     credentialHeader), tagged;
//   - if Body: Content-Type, Content-Encoding and either the selected
//     BodyFields (form: every value of each field; JSON: each field's value
//     made compact with object members sorted by name, a missing field
//     differing from null) or the SHA-256 of the whole body;
//   - unless ShareCountries, and only when the client asked for one:
//     who.Country and who.City, tagged, last (keys of requests that ask for
//     no country are the same bytes as before countries were keyed).
//
// h is the request header, with canonical keys as net/http builds it. who is
// the client (see [Requester]). body is
// the request body, already buffered by the caller; it is ignored unless the
// spec has Body set, and nil is the same as empty. The only errors are for a
// URL without a canonical form; they wrap [ErrInvalidURL].
func (k *Keyer) Key(method string, u *url.URL, h http.Header, who Requester, body []byte) (string, error) {
	kb := getKeyBuf()
	defer kb.put()
	cu, err := k.canonicalURL(kb.url[:0], u)
	kb.url = cu
	if err != nil {
		return "", err
	}

	b := appendString(kb.all[:0], keyVersion)
	if method == "" {
		method = http.MethodGet
	}
	b = appendString(b, method)
	b = appendBytes(b, cu)

	b = binary.AppendUvarint(b, uint64(len(k.headers)))
	for _, name := range k.headers {
		b = appendString(b, name)
		b = appendHeader(b, h[name])
	}
	for _, name := range conditionalHeaders {
		b = appendHeader(b, h[name])
	}

	if k.shareCredentials {
		b = append(b, 0)
	} else {
		b = append(b, 1)
		b = appendValues(b, h["Authorization"])
		b = appendCookies(b, h["Cookie"])
		b = appendUserinfo(b, u.User)
		b = appendString(b, who.Account)
	}

	if k.body {
		b = append(b, 1)
		b = k.appendBody(b, h, body)
	} else {
		b = append(b, 0)
	}
	if !k.shareCredentials {
		// Only when there are any, tagged, like the country below: keys
		// of requests without them are the bytes they were before.
		b = appendCredentialHeaders(b, h)
	}
	if !k.shareCountries && (who.Country != "" || who.City != "") {
		// Every component before is self-delimiting, so these trailing
		// bytes cannot make a key equal to one without them.
		b = append(b, 'g')
		b = appendString(b, who.Country)
		b = appendString(b, who.City)
	}
	kb.all = b
	return hexKey(keyVersion+":", sha256.Sum256(b)), nil
}

// variantKey is the key of one variant of the response stored under key:
// the variant a request with header values h gets when the response varies
// on the headers in vary. It has the form of any key, so stores, the fleet
// and invalidation by key treat it as one.
func variantKey(key string, vary []HeaderValue, h http.Header) string {
	b := appendString(make([]byte, 0, 128), "variant")
	b = appendString(b, key)
	for _, v := range vary {
		b = appendString(b, v.Name)
		b = appendString(b, joinValues(h.Values(v.Name)))
	}
	return hexKey(keyVersion+":", sha256.Sum256(b))
}

// hexKey returns prefix followed by the lower-case hex of sum.
func hexKey(prefix string, sum [sha256.Size]byte) string {
	var out [3 + 2*sha256.Size]byte
	n := copy(out[:], prefix)
	hex.Encode(out[n:], sum[:])
	return string(out[:n+2*sha256.Size])
}

// appendString appends s, prefixed with its length as a uvarint.
func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// appendBytes appends p, prefixed with its length as a uvarint.
func appendBytes(b, p []byte) []byte {
	b = binary.AppendUvarint(b, uint64(len(p)))
	return append(b, p...)
}

// trimOWS trims the optional whitespace (RFC 9110 section 5.6.3) around a
// header value.
func trimOWS(s string) string {
	for s != "" && (s[0] == ' ' || s[0] == '\t') {
		s = s[1:]
	}
	for s != "" && (s[len(s)-1] == ' ' || s[len(s)-1] == '\t') {
		s = s[:len(s)-1]
	}
	return s
}

// appendHeader appends a header: 0 when absent; else 1 and its values,
// trimmed and joined with ",", length-prefixed.
func appendHeader(b []byte, vals []string) []byte {
	if len(vals) == 0 {
		return append(b, 0)
	}
	n := len(vals) - 1
	for _, v := range vals {
		n += len(trimOWS(v))
	}
	b = append(b, 1)
	b = binary.AppendUvarint(b, uint64(n))
	for i, v := range vals {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, trimOWS(v)...)
	}
	return b
}

// appendValues appends the count of vals, then each trimmed value,
// length-prefixed. Unlike appendHeader it does not join: it is for headers
// that are not comma-separated lists, such as Authorization.
func appendValues(b []byte, vals []string) []byte {
	b = binary.AppendUvarint(b, uint64(len(vals)))
	for _, v := range vals {
		b = appendString(b, trimOWS(v))
	}
	return b
}

// cookieName returns the name of a cookie-pair "name=value".
func cookieName(pair string) string {
	name, _, _ := strings.Cut(pair, "=")
	return name
}

// appendCookies appends the cookie-pairs of all Cookie header lines (HTTP/2
// may split them over several), sorted stably by name, each length-prefixed
// after their count. A pair is kept whole, so "a" and "a=" stay distinct and
// nothing a server might read is lost; only the separators and the optional
// whitespace around pairs are dropped.
func appendCookies(b []byte, lines []string) []byte {
	var parr [16]string
	pairs := parr[:0]
	for _, line := range lines {
		for line != "" {
			var pair string
			pair, line, _ = strings.Cut(line, ";")
			if pair = trimOWS(pair); pair != "" {
				pairs = append(pairs, pair)
			}
		}
	}
	slices.SortStableFunc(pairs, func(x, y string) int {
		return strings.Compare(cookieName(x), cookieName(y))
	})
	b = binary.AppendUvarint(b, uint64(len(pairs)))
	for _, p := range pairs {
		b = appendString(b, p)
	}
	return b
}

// notCredentials are the header names requests carry most (browsers,
// HTTP libraries, the proxy's own): appendCredentialHeaders skips them with
// one lookup instead of reading their names.
var notCredentials = func() map[string]bool {
	m := map[string]bool{}
	for _, n := range []string{
		"Accept", "Accept-Encoding", "Accept-Language", "Authorization", "Cache-Control", "Connection",
		"Content-Encoding", "Content-Length", "Content-Type", "Cookie", "Dnt", "Host", "If-Match",
		"If-Modified-Since", "If-None-Match", "If-Range", "If-Unmodified-Since", "Origin", "Pragma",
		"Priority", "Range", "Referer", "Sec-Ch-Ua", "Sec-Ch-Ua-Mobile", "Sec-Ch-Ua-Platform",
		"Sec-Fetch-Dest", "Sec-Fetch-Mode", "Sec-Fetch-Site", "Sec-Fetch-User", "Te", "Upgrade-Insecure-Requests",
		"User-Agent", "Via", "X-Forwarded-For", "X-Requested-With",
	} {
		m[n] = true
	}
	return m
}()

// credentialWords mark a header name as a credential's, case aside:
// X-Api-Key, Api-Key, Ocp-Apim-Subscription-Key, X-Auth-Token,
// X-Access-Token, X-Amz-Security-Token, X-Csrf-Token, X-Session-Id,
// X-Client-Secret, X-Signature...
var credentialWords = []string{"key", "token", "auth", "secret", "session", "csrf", "xsrf", "signature", "password", "credential"}

// credentialHeader reports whether a header name (canonical) is named like
// a credential. Authorization and Cookie are keyed on their own.
func credentialHeader(name string) bool {
	if notCredentials[name] {
		return false
	}
	for _, w := range credentialWords {
		if containsFold(name, w) {
			return true
		}
	}
	return false
}

// containsFold reports whether s contains the lower-case ASCII word w,
// ignoring the case of s, without allocating.
func containsFold(s, w string) bool {
	for i := 0; i+len(w) <= len(s); i++ {
		j := 0
		for j < len(w) && s[i+j]|0x20 == w[j] {
			j++
		}
		if j == len(w) {
			return true
		}
	}
	return false
}

// appendCredentialHeaders appends, when h has any, 'c' and the headers
// named like credentials (credentialHeader) with their values, sorted by
// name: an API key or session token in a header of the site's own is as
// much who asks as Authorization is, and two clients with different ones
// must not share an answer. Nothing is appended without them.
func appendCredentialHeaders(b []byte, h http.Header) []byte {
	var narr [8]string
	names := narr[:0]
	for name := range h {
		if credentialHeader(name) {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		return b
	}
	slices.Sort(names)
	b = append(b, 'c')
	b = binary.AppendUvarint(b, uint64(len(names)))
	for _, name := range names {
		b = appendString(b, name)
		b = appendValues(b, h[name])
	}
	return b
}

// appendUserinfo appends the userinfo of the request URL. net/http clients
// turn it into an Authorization header, so it is a credential.
func appendUserinfo(b []byte, ui *url.Userinfo) []byte {
	if ui == nil {
		return append(b, 0)
	}
	b = append(b, 1)
	b = appendString(b, ui.Username())
	pw, ok := ui.Password()
	if !ok {
		return append(b, 0)
	}
	b = append(b, 1)
	return appendString(b, pw)
}

// appendBody appends the body component: Content-Type, Content-Encoding, then
// either 'f' and the form fields, 'j' and the JSON fields, or 'h' and the
// SHA-256 of the whole body.
func (k *Keyer) appendBody(b []byte, h http.Header, body []byte) []byte {
	ct, ce := h["Content-Type"], h["Content-Encoding"]
	b = appendHeader(b, ct)
	b = appendHeader(b, ce)
	if len(k.bodyFields) > 0 && len(ce) == 0 && len(ct) == 1 {
		if mt, _, err := mime.ParseMediaType(ct[0]); err == nil {
			switch {
			case mt == "application/x-www-form-urlencoded":
				if fb, ok := k.appendFormFields(b, body); ok {
					return fb
				}
			case mt == "application/json" || strings.HasSuffix(mt, "+json"):
				if fb, ok := k.appendJSONFields(b, body); ok {
					return fb
				}
			}
		}
	}
	sum := sha256.Sum256(body)
	b = append(b, 'h')
	return append(b, sum[:]...)
}

// appendFormFields appends the selected fields of a form body: for each, its
// name, then 0 if missing, or 1 and all its decoded values in order. It
// reports false when the body is not a valid form or has none of the fields.
func (k *Keyer) appendFormFields(b, body []byte) ([]byte, bool) {
	form, err := url.ParseQuery(string(body))
	if err != nil || !slices.ContainsFunc(k.bodyFields, func(name string) bool { _, ok := form[name]; return ok }) {
		return b, false
	}
	b = append(b, 'f')
	b = binary.AppendUvarint(b, uint64(len(k.bodyFields)))
	for _, name := range k.bodyFields {
		b = appendString(b, name)
		vals, ok := form[name]
		if !ok {
			b = append(b, 0)
			continue
		}
		b = append(b, 1)
		b = binary.AppendUvarint(b, uint64(len(vals)))
		for _, v := range vals {
			b = appendString(b, v)
		}
	}
	return b, true
}

// appendJSONFields appends the selected members of a top-level JSON object:
// for each, its name, then 0 if missing, or 1 and its canonical value (see
// [jsoncanon]). It reports false when the body is not a UTF-8 JSON object,
// has none of the fields, repeats a name anywhere that matters, or nests
// selected values too deeply.
func (k *Keyer) appendJSONFields(b, body []byte) ([]byte, bool) {
	members, ok := jsoncanon.Object(body)
	if !ok || !slices.ContainsFunc(k.bodyFields, func(name string) bool {
		_, found := slices.BinarySearchFunc(members, name, cmpMemberName)
		return found
	}) {
		return b, false
	}
	b = append(b, 'j')
	b = binary.AppendUvarint(b, uint64(len(k.bodyFields)))
	var canon []byte
	for _, name := range k.bodyFields {
		b = appendString(b, name)
		i, found := slices.BinarySearchFunc(members, name, cmpMemberName)
		if !found {
			b = append(b, 0)
			continue
		}
		if canon, ok = members[i].AppendValue(canon[:0]); !ok {
			return b, false
		}
		b = append(b, 1)
		b = appendBytes(b, canon)
	}
	return b, true
}

func cmpMemberName(m jsoncanon.Member, name string) int {
	return strings.Compare(m.Name, name)
}
