package urlcanon

import (
	"net/url"
	"strings"
	"testing"
)

// TestPathIsAppendsPath: Path is the path Append writes, on the fast path
// (nothing to normalize) and the slow one alike.
func TestPathIsAppendsPath(t *testing.T) {
	for _, raw := range []string{
		"http://h/", "http://h", "http://h/a/b", "http://h/a/./b/../c", "http://h/a/%2e%2E/b",
		"http://h/%61pi/", "http://h/a%2fb", "http://h/a%2Fb|", "http://h/caf%c3%a9/", "http://h/a b",
		"http://h/.hidden/x", "http://h/a/..", "http://h/~u/x:y@z;p=1",
	} {
		u, err := url.Parse(raw)
		if err != nil {
			t.Fatal(err)
		}
		b, err := Append(nil, u, nil)
		if err != nil {
			t.Fatal(err)
		}
		want := strings.TrimPrefix(string(b), "http://h")
		if i := strings.IndexByte(want, '?'); i >= 0 {
			want = want[:i]
		}
		if got := Path(u); got != want {
			t.Errorf("Path(%s) = %q, Append wrote %q", raw, got, want)
		}
	}
	plain, _ := url.Parse("http://h/a/b-c_d~e/f.html")
	if n := testing.AllocsPerRun(100, func() { _ = Path(plain) }); n != 0 {
		t.Errorf("Path of a plain path allocates %v times", n)
	}
}
