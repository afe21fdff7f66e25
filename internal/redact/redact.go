// Package redact hides the credentials in a URL, for logs and for errors a
// client or an operator's terminal may show.
package redact

import (
	"net/url"
	"strings"
)

// URL returns raw with its password masked (url.URL.Redacted). A URL that
// does not parse has everything before its last '@' masked: the parser's
// own error would otherwise quote the whole of it, password included.
func URL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.User == nil {
		if i := strings.LastIndex(raw, "@"); i >= 0 {
			return "<redacted>@" + raw[i+1:]
		}
		return raw
	}
	return u.Redacted()
}

// Error returns err's message with every occurrence of the URL raw in it
// masked as URL masks it.
func Error(err error, raw string) string {
	msg := err.Error()
	if raw == "" {
		return msg
	}
	return strings.ReplaceAll(msg, raw, URL(raw))
}
