package fingerprint

import (
	"context"
	"reflect"
	"testing"
)

func TestParseH1Head(t *testing.T) {
	head := "GET /a?b=1 HTTP/1.1\r\nHost: origin.test\r\nuser-agent: curl/7.88.1\r\nAccept: */*\r\n" +
		"X-Folded: one\r\n two\r\nCookie: a=1\r\nCookie: b=2\r\n\r\n"
	r, err := ParseH1Head([]byte(head))
	if err != nil {
		t.Fatal(err)
	}
	if r.Method != "GET" || r.Target != "/a?b=1" || r.Proto != "HTTP/1.1" {
		t.Errorf("request line %+v", r)
	}
	want := []string{"Host", "user-agent", "Accept", "X-Folded", "Cookie", "Cookie"}
	if !reflect.DeepEqual(r.Shape.HeaderOrder, want) {
		t.Errorf("order %q, want %q", r.Shape.HeaderOrder, want)
	}
	if r.Fields[3].Value != "one two" {
		t.Errorf("folded value %q", r.Fields[3].Value)
	}
	if r.Shape.Connection != "" {
		t.Errorf("Connection %q from a head without one", r.Shape.Connection)
	}
	// The Connection value as spelled, its lines joined.
	r, err = ParseH1Head([]byte("GET / HTTP/1.1\r\nconnection: Keep-Alive\r\nA: 1\r\nConnection: TE\r\n\r\n"))
	if err != nil || r.Shape.Connection != "Keep-Alive, TE" {
		t.Errorf("Connection %q, %v", r.Shape.Connection, err)
	}
	// Bare LF line ends, as net/http accepts.
	if r, err := ParseH1Head([]byte("GET / HTTP/1.0\nA: 1\n\n")); err != nil || !reflect.DeepEqual(r.Shape.HeaderOrder, []string{"A"}) {
		t.Errorf("LF head: %+v, %v", r, err)
	}
	for _, bad := range []string{
		"", "GET /\r\n\r\n", "GET / HTTP/1.1\r\nNoColon\r\n\r\n", "GET / HTTP/1.1\r\n folded-first\r\n\r\n",
		"GET / HTTP/1.1\r\nA: 1\r\n", "GET / HTTP/1.1\r\nBad Name: 1\r\n\r\n", "GET / HTTP/1.1\r\n\r\nextra",
	} {
		if _, err := ParseH1Head([]byte(bad)); err == nil {
			t.Errorf("ParseH1Head(%q): no error", bad)
		}
	}
}

func TestContextCarriers(t *testing.T) {
	ctx := context.Background()
	if ShapeFrom(ctx) != nil || FingerprintFrom(ctx) != nil {
		t.Fatal("empty context carries values")
	}
	s := &Shape{HeaderOrder: []string{"A"}}
	f := New(nil, nil)
	ctx = WithFingerprint(WithShape(ctx, s), f)
	if ShapeFrom(ctx) != s || FingerprintFrom(ctx) != f {
		t.Fatal("round trip lost a value")
	}
}
