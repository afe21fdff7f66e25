package hostmatch

import (
	"strings"
	"testing"
)

func TestMatch(t *testing.T) {
	s, err := Compile([]string{"api.example.com", "*.cdn.example", "Mixed.Case.Example.", "127.0.0.1", "*.Deep.Example"})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		host string
		want bool
	}{
		{"api.example.com", true},
		{"API.Example.COM.", true},
		{"x.api.example.com", false},
		{"example.com", false},
		{"a.cdn.example", true},
		{"a.b.cdn.example", true},
		{"A.B.C.CDN.Example.", true},
		{"cdn.example", false},
		{"evilcdn.example", false},
		{".cdn.example", false},
		{"a..cdn.example", false}, // an empty label: not a name
		{"mixed.case.example", true},
		{"127.0.0.1", true},
		{"127.0.0.2", false},
		{"x.deep.example", true},
		{"deep.example", false},
		{"", false},
		{".", false},
	} {
		if got := s.Match(tc.host); got != tc.want {
			t.Errorf("Match(%q) = %v, want %v", tc.host, got, tc.want)
		}
	}
	var none *Set
	if none.Match("a.example") || none.Len() != 0 {
		t.Error("a nil Set matched")
	}
	empty, _ := Compile(nil)
	if empty.Match("a.example") || empty.Len() != 0 {
		t.Error("an empty Set matched")
	}
}

func TestValid(t *testing.T) {
	for _, p := range []string{"example.com", "*.example.com", "localhost", "127.0.0.1", "_svc.lab", "Example.COM.", "xn--bcher-kva.example"} {
		if err := Valid(p); err != nil {
			t.Errorf("Valid(%q): %v", p, err)
		}
	}
	for _, tc := range []struct{ p, why string }{
		{"", "empty"},
		{"*", `"*" is not`},
		{"a/b", "without scheme, port or path"},
		{"http://a.example", "without scheme, port or path"},
		{"host:443", "without scheme, port or path"},
		{"[::1]", "without scheme, port or path"},
		{"*.*.x", "leading"},
		{"a.*.x", "leading"},
		{"a*.x", "leading"},
		{"*2captcha.com", "leading"},
		{"127.0.0.*", "leading"},
		{"a?.example", "not a host name"},
		{"[a-z].example", "not a host name"},
		{"two words", "not a host name"},
		{"a..b", "not a host name"},
		{"*.", "not a host name"},
		{"bücher.example", "not a host name"},
		{strings.Repeat("a", 64) + ".example", "not a host name"},
		{"example.1", "neither"},
		{"*.0.0.1", "neither"},
		{"2130706433", "neither"},
		{"0x7f.1", "neither"},
	} {
		err := Valid(tc.p)
		if err == nil || !strings.Contains(err.Error(), tc.why) {
			t.Errorf("Valid(%q) = %v, want an error saying %q", tc.p, err, tc.why)
		}
	}
	if _, err := Compile([]string{"ok.example", "*bad"}); err == nil || !strings.Contains(err.Error(), "[1]:") {
		t.Errorf("Compile: err = %v, want one naming index 1", err)
	}
}
