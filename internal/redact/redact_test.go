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
		"http://user:pw@gw.example:8080":      "http://user:xxxxx@gw.example:8080",
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
