// Package redact hides the credentials in a URL, for logs and for errors a
// client or an operator's terminal may show.
package redact

import (
	"errors"
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
