package redact

import (
	"errors"
	"net/url"
	"strings"
	"testing"
)

func TestURL(t *testing.T) {
	for raw, want := range map[string]string{
		"redis://:s3cret@127.0.0.1:6379/0":    "redis://:xxxxx@127.0.0.1:6379/0",
		"http://user:pw@gw.example:8080":      "http://xxxxx:xxxxx@gw.example:8080",
		"http://TOKEN:@gw.example:8001":       "http://xxxxx:xxxxx@gw.example:8001",
		"http://TOKEN@gw.example:8001":        "http://xxxxx@gw.example:8001",
		"redis://:s3cret@127.0.0.1:abc/0":     "<redacted>@127.0.0.1:abc/0",
		"redis://127.0.0.1:6379/0":            "redis://127.0.0.1:6379/0",
		"redis://:s3cret%zz@127.0.0.1:6379/0": "<redacted>@127.0.0.1:6379/0",
	} {
		if got := URL(raw); got != want {
			t.Errorf("URL(%q) = %q, want %q", raw, got, want)
		}
	}
	raw := "redis://:s3cret@127.0.0.1:abc/0"
	if err := Error(errors.New(`parse "`+raw+`": invalid port`), raw); strings.Contains(err.Error(), "s3cret") {
		t.Errorf("Error kept the password: %v", err)
	}
	perr := &url.Error{Op: "parse", URL: raw, Err: errors.New(`invalid port ":abc" after host`)}
	if err := Error(perr, raw); strings.Contains(err.Error(), "s3cret") {
		t.Errorf("Error kept the password of a *url.Error: %v", err)
	}
}

// TestAsWritten: a configured URL in an error reads as it was written
// (URL escaped it again: "my db" came out my%20db), its user name,
// password and secret parameters masked all the same (ParsedURL's rule).
func TestAsWritten(t *testing.T) {
	for raw, want := range map[string]string{
		"redis://:s3cret@127.0.0.1:6379/my db":          "redis://:xxxxx@127.0.0.1:6379/my db",
		"redis://user:p@ss:w0rd@host:6379/база":         "redis://xxxxx:xxxxx@host:6379/база",
		"redis://user:s3c%2Fret@host:6379/0?db=x y":     "redis://xxxxx:xxxxx@host:6379/0?db=x y",
		"redis://host:6379/0?api_key=S1&dial_timeout=x": "redis://host:6379/0?api_key=xxxxx&dial_timeout=x",
		"redis://user@host:6379/0":                      "redis://xxxxx@host:6379/0",
		"redis://:s3cret%zz@127.0.0.1:6379/0":           "<redacted>@127.0.0.1:6379/0",
		"unix://:s3cret@/tmp/redis.sock?db=1":           "unix://:xxxxx@/tmp/redis.sock?db=1",
	} {
		if got := AsWritten(raw); got != want {
			t.Errorf("AsWritten(%q) = %q, want %q", raw, got, want)
		}
	}
}

// TestQuerySecrets: the values of query parameters that carry credentials
// (api_key=, token=, sig=, X-Amz-Signature=...) are masked wherever a URL
// is shown, as its password is; every other parameter stays readable.
func TestQuerySecrets(t *testing.T) {
	for raw, want := range map[string]string{
		"https://api.example/v1?api_key=S1&q=shoes":                                         "https://api.example/v1?api_key=xxxxx&q=shoes",
		"https://api.example/v1?token=S1&access_token=S2&page=2":                            "https://api.example/v1?token=xxxxx&access_token=xxxxx&page=2",
		"https://api.example/v1?key=S1&keyword=boots":                                       "https://api.example/v1?key=xxxxx&keyword=boots",
		"https://api.example/v1?password=S1&sig=S2&signature=S3":                            "https://api.example/v1?password=xxxxx&sig=xxxxx&signature=xxxxx",
		"https://b.s3.example/o?X-Amz-Signature=S1&X-Amz-Credential=S2&X-Amz-Date=20260101": "https://b.s3.example/o?X-Amz-Signature=xxxxx&X-Amz-Credential=xxxxx&X-Amz-Date=20260101",
		"https://api.example/v1?apiKey=S1&clientSecret=S2":                                  "https://api.example/v1?apiKey=xxxxx&clientSecret=xxxxx",
		"https://api.example/v1?api%5Fkey=S1":                                               "https://api.example/v1?api%5Fkey=xxxxx",
		"https://api.example/v1?q=design&token":                                             "https://api.example/v1?q=design&token",
		"http://u:pw@api.example/v1?token=S1":                                               "http://xxxxx:xxxxx@api.example/v1?token=xxxxx",
		"https://api.example/v1?session=abc&id=7":                                           "https://api.example/v1?session=abc&id=7",
	} {
		checkURL(t, raw, want)
	}
	// In free text (an error, a library's log line) a URL's secret
	// parameters are masked too.
	for in, want := range map[string]string{
		`parse "https://a.example/x?token=S1&q=1": invalid`: `parse "https://a.example/x?token=xxxxx&q=1": invalid`,
		"Get https://a.example/?sig=S1 failed":              "Get https://a.example/?sig=xxxxx failed",
		"no url here: key=value":                            "no url here: key=value",
	} {
		if got := Text(in); got != want {
			t.Errorf("Text(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestPathCredentials: secrets in a URL's path were never masked (only
// its query's). No rule tells a secret path segment from the IDs, hashes
// and addresses that tell requests apart (etherscan's /token/<address>,
// a build's /app.<hash>.js), so only segments that are credentials by
// their own shape are: a JSON Web Token, and a Telegram bot token
// (api.telegram.org/bot<id>:<secret>/...), which a worker's own alerts send
// through the proxy its HTTPS_PROXY names.
func TestPathCredentials(t *testing.T) {
	const jwt = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
	const bot = "bot123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw"
	for raw, want := range map[string]string{
		"https://api.telegram.org/" + bot + "/sendMessage?chat_id=42": "https://api.telegram.org/botxxxxx/sendMessage?chat_id=42",
		"https://shop.example/verify/" + jwt:                          "https://shop.example/verify/xxxxx",
		"https://shop.example/verify/" + jwt + "/done":                "https://shop.example/verify/xxxxx/done",
		// Kept: what tells requests apart.
		"https://etherscan.io/token/0xdAC17F958D2ee523a2206206994597C13D831ec7": "https://etherscan.io/token/0xdAC17F958D2ee523a2206206994597C13D831ec7",
		"https://cdn.example/static/app.3f9a8b7c6d5e4f3a.js":                    "https://cdn.example/static/app.3f9a8b7c6d5e4f3a.js",
		"https://shop.example/p/3fa85f64-5717-4562-b3fc-2c963f66afa6":           "https://shop.example/p/3fa85f64-5717-4562-b3fc-2c963f66afa6",
		"https://shop.example/key/c-major/bot":                                  "https://shop.example/key/c-major/bot",
		"https://shop.example/robot123:abc":                                     "https://shop.example/robot123:abc",
		"https://shop.example/a%20b/c":                                          "https://shop.example/a%20b/c",
	} {
		checkURL(t, raw, want)
	}
	// A path logged alone, and an error quoting the URL.
	if got, want := Path("/"+bot+"/getUpdates"), "/botxxxxx/getUpdates"; got != want {
		t.Errorf("Path = %q, want %q", got, want)
	}
	in := `Post "https://api.telegram.org/` + bot + `/sendMessage": dial tcp: i/o timeout (session ` + jwt + `)`
	if got, want := Text(in), `Post "https://api.telegram.org/botxxxxx/sendMessage": dial tcp: i/o timeout (session xxxxx)`; got != want {
		t.Errorf("Text(%q) = %q, want %q", in, got, want)
	}
}

// checkURL checks that URL and ParsedURL both mask raw as want, and that
// ParsedURL leaves its argument as it was.
func checkURL(t *testing.T, raw, want string) {
	t.Helper()
	if got := URL(raw); got != want {
		t.Errorf("URL(%q) = %q, want %q", raw, got, want)
	}
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	if got := ParsedURL(u); got != want {
		t.Errorf("ParsedURL(%q) = %q, want %q", raw, got, want)
	}
	if u.String() != raw {
		t.Errorf("ParsedURL changed its argument: %q", u)
	}
}
