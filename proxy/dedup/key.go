package dedup

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"net/http"
	"net/netip"
	"net/textproto"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"

	"golang.org/x/net/idna"
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

// ErrInvalidURL is wrapped by every error from [CanonicalURL], [URLKey] and
// [Key]: the URL is not an absolute http or https URL with a valid host.
// Such a request cannot be keyed, so it must not be deduplicated.
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

// maxJSONDepth bounds the nesting of a selected JSON body field. Deeper values
// are not canonicalized; the whole body is hashed instead.
const maxJSONDepth = 64

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

	// ShareCredentials, when true, leaves Authorization, Cookie, URL
	// userinfo and the proxy user out of the key, so that clients with
	// different credentials share responses. Only for origins whose responses
	// do not depend on who asks.
	ShareCredentials bool

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

// A Keyer is a compiled [KeySpec]. It is immutable and safe for concurrent
// use; build one per rule with [NewKeyer] and reuse it for every request.
type Keyer struct {
	headers          []string // canonical, sorted, unique, without Accept-Encoding
	ignoreParams     []string
	shareCredentials bool
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

// CanonicalURL returns the normalized absolute URL used in keys, in the form
// scheme://host[:port]path[?query]. ignoreParams lists the query parameters to
// drop (see [KeySpec.IgnoreParams]); nil drops none.
//
// Normalization, following RFC 3986 section 6.2.2 where it applies:
//   - The scheme is lower-cased; only http and https are accepted. The URL
//     must be absolute, with a host.
//   - The host is lower-cased. A host with non-ASCII characters is converted
//     with IDNA (idna.Lookup.ToASCII); an invalid one is an error. An ASCII host
//     is only lower-cased and checked for letters, digits, '-', '_' and '.'
//     (like net/http, which skips IDNA for ASCII hosts: the IDNA lookup rules
//     reject real host names such as "a_b.example" or "r3---sn-x.example").
//     One trailing dot is removed; empty labels are an error. IPv6 literals
//     stay bracketed and are written in RFC 5952 form; a zone is kept
//     (only unreserved characters are accepted in it).
//   - The default port (http 80, https 443) and an empty port are dropped;
//     other ports are kept, without leading zeros.
//   - Userinfo and fragment are dropped.
//   - Path: empty becomes "/". Percent-encoding is normalized first: escapes
//     of unreserved characters (ALPHA / DIGIT / "-" / "." / "_" / "~") are
//     decoded, other escapes get upper-case hex, and characters that may not
//     appear raw are escaped ("%2f" becomes "%2F", never "/"). Then
//     dot-segments are removed (RFC 3986 section 5.2.4), so "%2E%2E" is a
//     dot-segment, as RFC 3986 section 6.2.2.3 and browsers have it.
//     Duplicate slashes are kept.
//   - Query: split on '&' (empty pieces dropped), each piece split into name
//     and value at the first '='; percent-encoding normalized as in paths,
//     '+' kept as is (not equated with %20). Parameters whose decoded name is
//     ignored are dropped; the rest are sorted by name, bytewise and stably,
//     so repeated parameters keep their relative order ("a=2&a=1" differs
//     from "a=1&a=2": servers read the first or the last one). "a" and "a="
//     differ. A query left empty drops the '?'.
//   - A '%' that does not start a valid escape is taken literally and
//     written as "%25".
func CanonicalURL(u *url.URL, ignoreParams []string) (string, error) {
	var buf [256]byte
	b, err := appendCanonicalURL(buf[:0], u, ignoreParams)
	if err != nil {
		return "", err
	}
	return string(b), nil
}

// CanonicalURL is like the package function [CanonicalURL], with the Keyer's
// ignored parameters.
func (k *Keyer) CanonicalURL(u *url.URL) (string, error) {
	return CanonicalURL(u, k.ignoreParams)
}

// URLKey returns "u1:" followed by the lower-case hex SHA-256 of the
// [CanonicalURL] of u. All variants of one URL (methods, headers, credentials,
// bodies) share it, so that an operator can invalidate every variant of a URL.
func URLKey(u *url.URL, ignoreParams []string) (string, error) {
	var buf [256]byte
	b, err := appendCanonicalURL(buf[:0], u, ignoreParams)
	if err != nil {
		return "", err
	}
	return hexKey("u1:", sha256.Sum256(b)), nil
}

// URLKey is like the package function [URLKey], with the Keyer's ignored
// parameters.
func (k *Keyer) URLKey(u *url.URL) (string, error) {
	return URLKey(u, k.ignoreParams)
}

// Key returns the request key: "v1:" followed by 64 lower-case hex digits of a
// SHA-256. Key compiles spec on every call; on a hot path, build a [Keyer]
// once and call its Key method.
func Key(method string, u *url.URL, h http.Header, user string, body []byte, spec *KeySpec) (string, error) {
	return NewKeyer(spec).Key(method, u, h, user, body)
}

// Key returns the request key: "v1:" followed by 64 lower-case hex digits of a
// SHA-256 over these components, each length-prefixed or tagged so that no
// two different sequences encode alike:
//
//   - the version tag "v1";
//   - the method, exactly as sent (methods are case-sensitive, RFC 9110
//     section 9.1); an empty method means GET, as in net/http;
//   - the [CanonicalURL], with the Keyer's ignored parameters;
//   - each keyed header, in sorted order: its name, whether it is present, and
//     its values trimmed of optional whitespace and joined with ",";
//   - Range, If-Range, If-Match, If-None-Match, If-Modified-Since and
//     If-Unmodified-Since, the same way, whatever the spec says;
//   - unless ShareCredentials: the Authorization values; the cookies (from all
//     Cookie headers, sorted stably by name, so their order does not matter);
//     the URL userinfo (net/http clients send it as Authorization); and user,
//     the authenticated proxy user ("" for none);
//   - if Body: Content-Type, Content-Encoding and either the selected
//     BodyFields (form: every value of each field; JSON: each field's value
//     made compact with object members sorted by name, a missing field
//     differing from null) or the SHA-256 of the whole body.
//
// h is the request header, with canonical keys as net/http builds it. body is
// the request body, already buffered by the caller; it is ignored unless the
// spec has Body set, and nil is the same as empty. The only errors are those of
// [CanonicalURL].
func (k *Keyer) Key(method string, u *url.URL, h http.Header, user string, body []byte) (string, error) {
	var ubuf [256]byte
	cu, err := appendCanonicalURL(ubuf[:0], u, k.ignoreParams)
	if err != nil {
		return "", err
	}

	var buf [1024]byte
	b := appendString(buf[:0], keyVersion)
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
		b = appendString(b, user)
	}

	if k.body {
		b = append(b, 1)
		b = k.appendBody(b, h, body)
	} else {
		b = append(b, 0)
	}
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
// canonJSON). It reports false when the body is not a UTF-8 JSON object, has none
// of the fields, repeats a name anywhere that matters, or nests selected
// values too deeply.
func (k *Keyer) appendJSONFields(b, body []byte) ([]byte, bool) {
	// Decoders replace invalid UTF-8 with U+FFFD, so different member names
	// could decode alike (and RFC 8259 requires UTF-8 anyway).
	if !utf8.Valid(body) || !json.Valid(body) {
		return b, false
	}
	data := bytes.TrimLeft(body, " \t\r\n")
	if data[0] != '{' {
		return b, false
	}
	data = data[:jsonValueEnd(data, 0)]
	members, ok := jsonObject(data)
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
		if canon, ok = canonJSON(canon[:0], members[i].value, 1); !ok {
			return b, false
		}
		b = append(b, 1)
		b = appendBytes(b, canon)
	}
	return b, true
}

// jsonMember is one member of a JSON object.
type jsonMember struct {
	name  string // decoded
	key   []byte // raw string literal, quotes included
	value []byte // raw value
}

func cmpMemberName(m jsonMember, name string) int {
	return strings.Compare(m.name, name)
}

// isJSONSpace reports whether c is JSON insignificant whitespace.
func isJSONSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\r' || c == '\n'
}

// skipJSONSpace returns the index of the first non-space byte at or after i.
func skipJSONSpace(data []byte, i int) int {
	for i < len(data) && isJSONSpace(data[i]) {
		i++
	}
	return i
}

// jsonValueEnd returns the end of the value that starts at data[i]. data must
// be valid JSON (json.Valid), so the scan needs no error handling.
func jsonValueEnd(data []byte, i int) int {
	switch data[i] {
	case '"':
		for j := i + 1; ; j++ {
			switch data[j] {
			case '\\':
				j++
			case '"':
				return j + 1
			}
		}
	case '{', '[':
		depth := 0
		for j := i; ; j++ {
			switch data[j] {
			case '"':
				j = jsonValueEnd(data, j) - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return j + 1
				}
			}
		}
	default: // number, true, false, null
		j := i
		for j < len(data) && !isJSONSpace(data[j]) && data[j] != ',' && data[j] != '}' && data[j] != ']' {
			j++
		}
		return j
	}
}

// jsonObject returns the members of the valid JSON object data, sorted by
// decoded name. It reports false if two members share a decoded name (parsers
// disagree on which one wins) or a name cannot be decoded exactly.
func jsonObject(data []byte) ([]jsonMember, bool) {
	var members []jsonMember
	i := skipJSONSpace(data, 1)
	for data[i] != '}' {
		ke := jsonValueEnd(data, i)
		name, ok := jsonString(data[i:ke])
		if !ok {
			return nil, false
		}
		vs := skipJSONSpace(data, skipJSONSpace(data, ke)+1) // past ':'
		ve := jsonValueEnd(data, vs)
		members = append(members, jsonMember{name: name, key: data[i:ke], value: data[vs:ve]})
		i = skipJSONSpace(data, ve)
		if data[i] == ',' {
			i = skipJSONSpace(data, i+1)
		}
	}
	slices.SortFunc(members, func(x, y jsonMember) int { return strings.Compare(x.name, y.name) })
	for i := 1; i < len(members); i++ {
		if members[i].name == members[i-1].name {
			return nil, false
		}
	}
	return members, true
}

// canonJSON appends the canonical form of the valid JSON value v: no
// insignificant whitespace, object members sorted by decoded name. Strings
// (member names included) and numbers keep their literal spelling, so "\u0041"
// and "A", or 1 and 1.0, stay distinct: telling them apart is never wrong,
// merging them could be. It reports false for a repeated member name or
// nesting deeper than maxJSONDepth.
func canonJSON(dst, v []byte, depth int) ([]byte, bool) {
	switch v[0] {
	case '{':
		if depth > maxJSONDepth {
			return dst, false
		}
		members, ok := jsonObject(v)
		if !ok {
			return dst, false
		}
		dst = append(dst, '{')
		for i, m := range members {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = append(dst, m.key...)
			dst = append(dst, ':')
			if dst, ok = canonJSON(dst, m.value, depth+1); !ok {
				return dst, false
			}
		}
		return append(dst, '}'), true
	case '[':
		if depth > maxJSONDepth {
			return dst, false
		}
		dst = append(dst, '[')
		i := skipJSONSpace(v, 1)
		for first := true; v[i] != ']'; first = false {
			e := jsonValueEnd(v, i)
			if !first {
				dst = append(dst, ',')
			}
			var ok bool
			if dst, ok = canonJSON(dst, v[i:e], depth+1); !ok {
				return dst, false
			}
			i = skipJSONSpace(v, e)
			if v[i] == ',' {
				i = skipJSONSpace(v, i+1)
			}
		}
		return append(dst, ']'), true
	default:
		return append(dst, v...), true
	}
}

// jsonString decodes the valid JSON string literal lit (quotes included). Raw
// bytes are kept as they are; it reports false for an escaped lone surrogate,
// which decoders replace with U+FFFD, so that two different names would decode
// alike.
func jsonString(lit []byte) (string, bool) {
	s := lit[1 : len(lit)-1]
	if bytes.IndexByte(s, '\\') < 0 {
		return string(s), true
	}
	out := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c != '\\' {
			out = append(out, c)
			continue
		}
		i++
		switch s[i] {
		case 'b':
			out = append(out, '\b')
		case 'f':
			out = append(out, '\f')
		case 'n':
			out = append(out, '\n')
		case 'r':
			out = append(out, '\r')
		case 't':
			out = append(out, '\t')
		case 'u':
			r := hex4(s[i+1 : i+5])
			i += 4
			if utf16.IsSurrogate(r) {
				if r >= 0xDC00 || i+6 >= len(s) || s[i+1] != '\\' || s[i+2] != 'u' {
					return "", false
				}
				r2 := hex4(s[i+3 : i+7])
				if r2 < 0xDC00 || r2 > 0xDFFF {
					return "", false
				}
				r = utf16.DecodeRune(r, r2)
				i += 6
			}
			out = utf8.AppendRune(out, r)
		default: // '"', '\\', '/'
			out = append(out, s[i])
		}
	}
	return string(out), true
}

// hex4 decodes four hex digits, already validated by json.Valid.
func hex4(h []byte) rune {
	var r rune
	for _, c := range h {
		r = r<<4 | rune(unhex(c))
	}
	return r
}

// Character classes for percent-encoding normalization (RFC 3986 appendix A).
const (
	classUnreserved = 1 << iota // ALPHA / DIGIT / "-" / "." / "_" / "~"
	classPath                   // may appear raw in a path: pchar / "/"
	classQuery                  // may appear raw in a query: pchar / "/" / "?"
)

var charClass = func() (t [256]uint8) {
	for c := 0; c < 256; c++ {
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9',
			c == '-', c == '.', c == '_', c == '~':
			t[c] = classUnreserved | classPath | classQuery
		case strings.IndexByte("!$&'()*+,;=:@/", byte(c)) >= 0: // sub-delims, ":", "@", "/"
			t[c] = classPath | classQuery
		case c == '?':
			t[c] = classQuery
		}
	}
	return t
}()

const upperHex = "0123456789ABCDEF"

func ishex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

func unhex(c byte) byte {
	switch {
	case '0' <= c && c <= '9':
		return c - '0'
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10
	default:
		return c - 'A' + 10
	}
}

// appendNormalized appends s, a percent-encoded URL component, with its
// percent-encoding normalized: escapes of unreserved characters decoded, other
// escapes in upper-case hex, and every byte outside class (a stray '%'
// included) escaped.
func appendNormalized(b []byte, s string, class uint8) []byte {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c == '%' && i+2 < len(s) && ishex(s[i+1]) && ishex(s[i+2]) {
			c = unhex(s[i+1])<<4 | unhex(s[i+2])
			i += 2
			if charClass[c]&classUnreserved != 0 {
				b = append(b, c)
			} else {
				b = append(b, '%', upperHex[c>>4], upperHex[c&15])
			}
			continue
		}
		if c != '%' && charClass[c]&class != 0 {
			b = append(b, c)
		} else {
			b = append(b, '%', upperHex[c>>4], upperHex[c&15])
		}
	}
	return b
}

// appendCanonicalURL appends the canonical form of u (see CanonicalURL).
func appendCanonicalURL(b []byte, u *url.URL, ignoreParams []string) ([]byte, error) {
	if u == nil {
		return b, fmt.Errorf("%w: nil URL", ErrInvalidURL)
	}
	var https bool
	switch {
	case strings.EqualFold(u.Scheme, "http"):
	case strings.EqualFold(u.Scheme, "https"):
		https = true
	case u.Scheme == "":
		return b, fmt.Errorf("%w: not absolute", ErrInvalidURL)
	default:
		return b, fmt.Errorf("%w: unsupported scheme %q", ErrInvalidURL, u.Scheme)
	}
	if u.Opaque != "" || u.Host == "" {
		return b, fmt.Errorf("%w: no host", ErrInvalidURL)
	}
	if https {
		b = append(b, "https://"...)
	} else {
		b = append(b, "http://"...)
	}
	b, err := appendHostPort(b, u.Host, https)
	if err != nil {
		return b, err
	}
	b = appendPath(b, u)
	return appendQuery(b, u.RawQuery, ignoreParams), nil
}

// appendHostPort appends the canonical host and port of hostport, a
// url.URL.Host.
func appendHostPort(b []byte, hostport string, https bool) ([]byte, error) {
	host, port := hostport, ""
	var err error
	if strings.HasPrefix(host, "[") {
		end := strings.LastIndexByte(host, ']')
		if end < 0 {
			return b, fmt.Errorf("%w: host %q: missing ']'", ErrInvalidURL, hostport)
		}
		if rest := host[end+1:]; rest != "" {
			if rest[0] != ':' {
				return b, fmt.Errorf("%w: host %q: junk after ']'", ErrInvalidURL, hostport)
			}
			port = rest[1:]
		}
		b, err = appendIPv6(b, host[1:end])
	} else {
		if i := strings.LastIndexByte(host, ':'); i >= 0 {
			host, port = host[:i], host[i+1:]
		}
		b, err = appendRegName(b, host)
	}
	if err != nil {
		return b, err
	}
	return appendPort(b, port, https)
}

// appendIPv6 appends the bracketed IPv6 literal lit (without brackets, zone
// after '%' unescaped, as url.Parse leaves it) in RFC 5952 form.
func appendIPv6(b []byte, lit string) ([]byte, error) {
	addr, zone, hasZone := strings.Cut(lit, "%")
	ip, err := netip.ParseAddr(addr)
	if err != nil || !ip.Is6() || ip.Zone() != "" {
		return b, fmt.Errorf("%w: invalid IPv6 literal %q", ErrInvalidURL, lit)
	}
	if hasZone {
		if zone == "" {
			return b, fmt.Errorf("%w: empty IPv6 zone in %q", ErrInvalidURL, lit)
		}
		for i := 0; i < len(zone); i++ {
			if charClass[zone[i]]&classUnreserved == 0 {
				return b, fmt.Errorf("%w: unsupported IPv6 zone %q", ErrInvalidURL, zone)
			}
		}
	}
	b = append(b, '[')
	b = ip.AppendTo(b)
	if hasZone {
		b = append(b, "%25"...)
		b = append(b, zone...)
	}
	return append(b, ']'), nil
}

// appendRegName appends the canonical form of the host name host.
func appendRegName(b []byte, host string) ([]byte, error) {
	for i := 0; i < len(host); i++ {
		if host[i] < utf8.RuneSelf {
			continue
		}
		if !utf8.ValidString(host) {
			return b, fmt.Errorf("%w: host %q is not UTF-8", ErrInvalidURL, host)
		}
		a, err := idna.Lookup.ToASCII(host)
		if err != nil {
			return b, fmt.Errorf("%w: host %q: %v", ErrInvalidURL, host, err)
		}
		host = a
		break
	}
	host = strings.TrimSuffix(host, ".")
	if host == "" {
		return b, fmt.Errorf("%w: empty host", ErrInvalidURL)
	}
	dot := true // the previous byte ended a label (or there was none yet)
	for i := 0; i < len(host); i++ {
		c := host[i]
		switch {
		case 'A' <= c && c <= 'Z':
			c += 'a' - 'A'
		case 'a' <= c && c <= 'z', '0' <= c && c <= '9', c == '-', c == '_':
		case c == '.':
			if dot {
				return b, fmt.Errorf("%w: empty label in host %q", ErrInvalidURL, host)
			}
		default:
			return b, fmt.Errorf("%w: invalid character %q in host %q", ErrInvalidURL, c, host)
		}
		dot = c == '.'
		b = append(b, c)
	}
	if dot {
		return b, fmt.Errorf("%w: empty label in host %q", ErrInvalidURL, host)
	}
	return b, nil
}

// appendPort appends ":port" unless port is empty or the scheme's default.
func appendPort(b []byte, port string, https bool) ([]byte, error) {
	if port == "" {
		return b, nil
	}
	n := 0
	for i := 0; i < len(port); i++ {
		c := port[i]
		if c < '0' || c > '9' {
			return b, fmt.Errorf("%w: invalid port %q", ErrInvalidURL, port)
		}
		if n = n*10 + int(c-'0'); n > 65535 {
			return b, fmt.Errorf("%w: port %q out of range", ErrInvalidURL, port)
		}
	}
	switch {
	case n == 0:
		return b, fmt.Errorf("%w: port %q out of range", ErrInvalidURL, port)
	case https && n == 443, !https && n == 80:
		return b, nil
	}
	b = append(b, ':')
	return strconv.AppendInt(b, int64(n), 10), nil
}

// appendPath appends the canonical path of u.
func appendPath(b []byte, u *url.URL) []byte {
	// RawPath keeps the client's escaping ("/a%2Fb", whose Path is "/a/b").
	// Use it whenever it encodes Path, even if EscapedPath would reject it
	// for holding raw bytes that need escaping: EscapedPath would then
	// re-escape Path and turn %2F into '/'.
	src := u.RawPath
	if src == "" || !unescapesTo(src, u.Path) {
		src = u.EscapedPath()
	}
	start := len(b)
	if !strings.HasPrefix(src, "/") {
		b = append(b, '/')
	}
	b = appendNormalized(b, src, classPath)
	return b[:start+len(removeDotSegments(b[start:]))]
}

// unescapesTo reports whether percent-decoding raw yields exactly path.
func unescapesTo(raw, path string) bool {
	j := 0
	for i := 0; i < len(raw); i, j = i+1, j+1 {
		c := raw[i]
		if c == '%' {
			if i+2 >= len(raw) || !ishex(raw[i+1]) || !ishex(raw[i+2]) {
				return false
			}
			c = unhex(raw[i+1])<<4 | unhex(raw[i+2])
			i += 2
		}
		if j >= len(path) || path[j] != c {
			return false
		}
	}
	return j == len(path)
}

// hasDotSegment reports whether the path p has a "." or ".." segment.
func hasDotSegment(p []byte) bool {
	for i := 0; i < len(p); i++ {
		if p[i] != '/' {
			continue
		}
		seg := p[i+1:]
		if j := bytes.IndexByte(seg, '/'); j >= 0 {
			seg = seg[:j]
		}
		if string(seg) == "." || string(seg) == ".." {
			return true
		}
	}
	return false
}

// removeDotSegments applies RFC 3986 section 5.2.4 in place to p, which
// starts with '/', and returns the result. Steps 2A and 2D cannot apply
// to a path that starts with '/'.
func removeDotSegments(p []byte) []byte {
	if !hasDotSegment(p) {
		return p
	}
	w := 0 // p[:w] is the output buffer; it never overtakes the input p[i:]
	for i := 0; i < len(p); {
		in := p[i:]
		switch {
		case bytes.HasPrefix(in, []byte("/./")): // 2B
			i += 2
		case string(in) == "/.": // 2B
			i++
			p[i] = '/'
		case bytes.HasPrefix(in, []byte("/../")): // 2C
			i += 3
			w = max(bytes.LastIndexByte(p[:w], '/'), 0)
		case string(in) == "/..": // 2C
			i += 2
			p[i] = '/'
			w = max(bytes.LastIndexByte(p[:w], '/'), 0)
		default: // 2E: move "/segment" to the output
			j := 1
			for j < len(in) && in[j] != '/' {
				j++
			}
			w += copy(p[w:], in[:j])
			i += j
		}
	}
	return p[:w]
}

// qparam locates one normalized query parameter in the output buffer.
type qparam struct {
	start, nameEnd, end int
}

// appendQuery appends "?" and the canonical form of the raw query, or nothing
// if no parameter is left.
func appendQuery(b []byte, raw string, ignoreParams []string) []byte {
	if raw == "" {
		return b
	}
	mark := len(b)
	b = append(b, '?')
	base := len(b)
	var parr [16]qparam
	params := parr[:0]
	for raw != "" {
		var piece string
		piece, raw, _ = strings.Cut(raw, "&")
		if piece == "" {
			continue
		}
		pmark := len(b)
		if len(params) > 0 {
			b = append(b, '&')
		}
		start := len(b)
		name, value, hasValue := strings.Cut(piece, "=")
		b = appendNormalized(b, name, classQuery)
		nameEnd := len(b)
		if ignored(b[start:nameEnd], ignoreParams) {
			b = b[:pmark]
			continue
		}
		if hasValue {
			b = append(b, '=')
			b = appendNormalized(b, value, classQuery)
		}
		params = append(params, qparam{start, nameEnd, len(b)})
	}
	if len(params) == 0 {
		return b[:mark]
	}
	name := func(p qparam) []byte { return b[p.start:p.nameEnd] }
	cmp := func(x, y qparam) int { return bytes.Compare(name(x), name(y)) }
	if slices.IsSortedFunc(params, cmp) {
		return b
	}
	slices.SortStableFunc(params, cmp)
	var tarr [256]byte
	tmp := append(tarr[:0], b[base:]...)
	b = b[:base]
	for i, p := range params {
		if i > 0 {
			b = append(b, '&')
		}
		b = append(b, tmp[p.start-base:p.end-base]...)
	}
	return b
}

// ignored reports whether the query parameter with the normalized name is
// dropped by ignoreParams.
func ignored(name []byte, ignoreParams []string) bool {
	if len(ignoreParams) == 0 {
		return false
	}
	if bytes.IndexByte(name, '%') >= 0 || bytes.IndexByte(name, '+') >= 0 {
		// Normalized, so every '%' starts a valid escape.
		decoded, _ := url.QueryUnescape(string(name))
		name = []byte(decoded)
	}
	for _, p := range ignoreParams {
		if prefix, ok := strings.CutSuffix(p, "*"); ok {
			if len(name) >= len(prefix) && string(name[:len(prefix)]) == prefix {
				return true
			}
		} else if string(name) == p {
			return true
		}
	}
	return false
}
