// Package redact hides the credentials in a URL, for logs and for errors a
// client or an operator's terminal may show: its user name and password,
// the values of its query parameters that carry one (api_key=,
// access_token=, sig=), and the path segments that are credentials by
// their shape (a JSON Web Token, a Telegram bot token; see Path).
// It is the one rule for that: every URL written to a log or an error goes
// through it.
package redact

import (
	"errors"
	"net/url"
	"regexp"
	"strings"
	"unicode"
)

// mask replaces a secret, as url.URL.Redacted masks a password.
const mask = "xxxxx"

// URL returns raw with its user name, password and the values of its
// secret query parameters masked (see ParsedURL). A URL that does not parse has
// everything before its last '@' masked: the parser's own error would
// otherwise quote the whole of it, password included.
func URL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		if i := strings.LastIndex(raw, "@"); i >= 0 {
			raw = "<redacted>@" + raw[i+1:]
		}
		return Text(raw)
	}
	return ParsedURL(u)
}

// AsWritten returns raw as the operator wrote it, with its user name and
// password (as ParsedURL masks them) and the values of its secret query
// parameters masked: for an error about a configured URL, which its author
// must recognise. URL serializes the parsed URL again, escaping what was
// written plainly (a path "my db" became my%20db, a name in Cyrillic a row
// of %XX). A URL that does not parse is masked as URL masks it.
func AsWritten(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return URL(raw)
	}
	if u.User != nil {
		// Where url.Parse found the user information: the authority
		// runs from "//" to the first '/', '?' or '#', and the user
		// information ends at its last '@'.
		start := strings.Index(raw, "//") + 2
		end := len(raw)
		if i := strings.IndexAny(raw[start:], "/?#"); i >= 0 {
			end = start + i
		}
		at := strings.LastIndex(raw[start:end], "@")
		if start < 2 || at < 0 {
			return URL(raw) // not where url.Parse found it: take no chance
		}
		raw = raw[:start] + maskUser(u.User).String() + raw[start+at:]
	}
	return Text(raw)
}

// ParsedURL is u as a string with its user name and password, and the
// values of its secret query parameters (SecretParam), masked. The user
// name goes as the password does (url.URL.Redacted keeps it): rotating
// proxy providers put the account's token there (http://TOKEN:@gw,
// http://KEY:render_js=false@gw), and a session's credentials are one
// secret whichever half holds it. An empty user name stays empty
// (redis://:xxxxx@host): nothing is hidden there. The other parameters
// are kept as they were sent, in their order: the operator reading a log
// needs to tell requests apart. u is not modified.
func ParsedURL(u *url.URL) string {
	if u == nil {
		return ""
	}
	q := query(u.RawQuery)
	ep := u.EscapedPath()
	p := Path(ep)
	if u.User == nil && q == u.RawQuery && p == ep {
		return u.String() // the common case: nothing to hide, no copy
	}
	c := *u
	c.RawQuery = q
	if p != ep {
		if up, err := url.PathUnescape(p); err == nil {
			c.Path, c.RawPath = up, p
		}
	}
	if c.User != nil {
		c.User = maskUser(c.User)
	}
	return c.String()
}

// Path is a URL's path (as sent, or as logged alone) with the segments
// that are credentials by their own shape masked: a JSON Web Token (three
// base64url parts, the first two opening with "eyJ", which is `{"`), and
// a Telegram bot token (bot<id>:<secret>, api.telegram.org/bot.../
// sendMessage, which a worker's own alerts send through the proxy its
// HTTPS_PROXY names). Nothing else in a path is masked: no rule tells a
// secret segment (a webhook's, an API key after /v3/) from the IDs,
// hashes and addresses that tell requests apart (etherscan's
// /token/<address>, a build's /app.<hash>.js) without hiding those too,
// and a log whose failing requests all read /token/xxxxx is no log. The
// README's logging section says so.
func Path(p string) string { return shapes(p) }

var (
	// The leading group keeps the character before a match: a token
	// starts at a boundary, not inside a longer word ("robot123:...").
	jwtShape      = regexp.MustCompile(`(^|[^A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{4,}\.eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{8,}`)
	botTokenShape = regexp.MustCompile(`(^|[^A-Za-z0-9_-])bot[0-9]{5,}:[A-Za-z0-9_-]{30,}`)
)

// shapes masks the credentials s holds that say what they are by their
// shape alone (see Path), wherever they stand.
func shapes(s string) string {
	if strings.Contains(s, "eyJ") {
		s = jwtShape.ReplaceAllString(s, "${1}"+mask)
	}
	if strings.Contains(s, "bot") {
		s = botTokenShape.ReplaceAllString(s, "${1}bot"+mask)
	}
	return s
}

// maskUser is ui with its user name and password (those it has) masked.
func maskUser(ui *url.Userinfo) *url.Userinfo {
	name := ui.Username()
	if name != "" {
		name = mask
	}
	if _, ok := ui.Password(); ok {
		return url.UserPassword(name, mask)
	}
	return url.User(name)
}

// query masks the secret parameters' values in a raw query string.
func query(raw string) string {
	if raw == "" || !strings.Contains(raw, "=") {
		return raw
	}
	var b strings.Builder
	changed := false
	for i, part := range strings.Split(raw, "&") {
		if i > 0 {
			b.WriteByte('&')
		}
		name, value, ok := strings.Cut(part, "=")
		if ok && value != "" && value != mask && SecretParam(unescape(name)) {
			b.WriteString(name)
			b.WriteString("=" + mask)
			changed = true
			continue
		}
		b.WriteString(part)
	}
	if !changed {
		return raw
	}
	return b.String()
}

func unescape(name string) string {
	if n, err := url.QueryUnescape(name); err == nil {
		return n
	}
	return name
}

// secretWords are the words of a parameter name that say its value is a
// credential. A name is split into words first (api_key, apiKey,
// X-Amz-Signature), so that a word inside another (keyword, design) is
// no match.
var secretWords = map[string]bool{
	"key": true, "apikey": true, "token": true, "password": true, "passwd": true,
	"pwd": true, "pass": true, "secret": true, "signature": true, "sig": true,
	"credential": true, "credentials": true, "auth": true, "authorization": true,
}

// SecretParam reports whether a query parameter's name says its value is
// a credential: a word of it (split at '_', '-', '.' and lower-to-upper
// case changes) is key, token, password, secret, signature, sig,
// credential, auth or the like.
func SecretParam(name string) bool {
	start := 0
	rs := []rune(name)
	for i := 0; i <= len(rs); i++ {
		end := i == len(rs)
		split := end || !unicode.IsLetter(rs[i]) && !unicode.IsDigit(rs[i]) ||
			i > 0 && unicode.IsUpper(rs[i]) && unicode.IsLower(rs[i-1])
		if !split {
			continue
		}
		if i > start && secretWords[strings.ToLower(string(rs[start:i]))] {
			return true
		}
		start = i
		if !end && !unicode.IsLetter(rs[i]) && !unicode.IsDigit(rs[i]) {
			start = i + 1
		}
	}
	return false
}

// Text masks, in free text (an error's message, a library's log line),
// the values of secret query parameters of the URLs it quotes: every
// "?name=value" or "&name=value" whose name SecretParam takes (a value
// ends at '&', '#', white space or a quote), and the credentials Path
// knows by their shape, wherever they stand.
func Text(s string) string {
	s = shapes(s)
	if !strings.ContainsAny(s, "?&") || !strings.Contains(s, "=") {
		return s
	}
	var b strings.Builder
	changed := false
	rest := s
	for {
		i := strings.IndexAny(rest, "?&")
		if i < 0 {
			break
		}
		b.WriteString(rest[:i+1])
		rest = rest[i+1:]
		eq := strings.IndexByte(rest, '=')
		if eq <= 0 || strings.ContainsAny(rest[:eq], "?& \t\n\"'") {
			continue
		}
		end := eq + 1 + strings.IndexFunc(rest[eq+1:], func(r rune) bool {
			return r == '&' || r == '#' || r == '"' || r == '\'' || r == '`' || unicode.IsSpace(r)
		})
		if end == eq {
			end = len(rest) // the value runs to the end
		}
		if end > eq+1 && rest[eq+1:end] != mask && SecretParam(unescape(rest[:eq])) {
			b.WriteString(rest[:eq+1] + mask)
			rest = rest[end:]
			changed = true
		}
	}
	if !changed {
		return s
	}
	b.WriteString(rest)
	return b.String()
}

// Error returns err, the failure to parse the URL raw, without raw in
// clear: the reason of a *url.Error (which quotes its whole URL, password
// included), or err with every occurrence of raw masked as URL masks it.
func Error(err error, raw string) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	if raw == "" || !strings.Contains(err.Error(), raw) {
		return err
	}
	return errors.New(strings.ReplaceAll(err.Error(), raw, URL(raw)))
}
