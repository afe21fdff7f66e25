package redact

import (
	"errors"
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
	if msg := Error(errors.New(`parse "`+raw+`": invalid port`), raw); strings.Contains(msg, "s3cret") {
		t.Errorf("Error kept the password: %s", msg)
	}
}
