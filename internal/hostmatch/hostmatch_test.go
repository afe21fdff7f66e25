package hostmatch

import "testing"

func TestAny(t *testing.T) {
	patterns := []string{"api.example.com", "*.cdn.example"}
	for _, tc := range []struct {
		host string
		want bool
	}{
		{"api.example.com", true},
		{"API.Example.COM.", true},
		{"x.api.example.com", false},
		{"a.cdn.example", true},
		{"a.b.cdn.example", true},
		{"cdn.example", false},
		{"evilcdn.example", false},
		{"", false},
	} {
		if got := Any(patterns, tc.host); got != tc.want {
			t.Errorf("Any(%q) = %v, want %v", tc.host, got, tc.want)
		}
	}
}

func TestValid(t *testing.T) {
	for _, p := range []string{"example.com", "*.example.com", "localhost", "127.0.0.1"} {
		if err := Valid(p); err != nil {
			t.Errorf("Valid(%q): %v", p, err)
		}
	}
	for _, p := range []string{"", "a/b", "host:443", "*.*.x", "a*.x", "two words"} {
		if Valid(p) == nil {
			t.Errorf("Valid(%q) accepted", p)
		}
	}
}
