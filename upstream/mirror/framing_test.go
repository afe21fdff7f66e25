package mirror

import (
	"io"
	"slices"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/fporigin"
)

// TestBodilessPostFraming: a POST without a body that the client
// sent without Content-Length (curl -X POST) goes out without one, on
// HTTP/1.1 and HTTP/2: the origin sees the client's header fields, not
// net/http's "Content-Length: 0". A client that sent the field keeps it
// in its place, and without a shape the request is framed as net/http
// frames it.
func TestBodilessPostFraming(t *testing.T) {
	o := startOrigin(t, fporigin.Options{})
	cases := []struct {
		name  string
		alpn  string
		shape *fingerprint.Shape
		want  []string
	}{
		{"h1 without", "http/1.1", &fingerprint.Shape{HeaderOrder: []string{"Host", "User-Agent", "Accept"}},
			[]string{"Host", "User-Agent", "Accept"}},
		{"h1 with", "http/1.1", &fingerprint.Shape{HeaderOrder: []string{"Host", "Content-Length", "User-Agent", "Accept"}},
			[]string{"Host", "Content-Length", "User-Agent", "Accept"}},
		{"h1 no shape", "http/1.1", nil, []string{"Host", "Accept", "Content-Length", "User-Agent"}},
		{"h2 without", "h2", &fingerprint.Shape{HeaderOrder: []string{"user-agent", "accept"}, PseudoOrder: []string{":method", ":path", ":scheme", ":authority"}},
			[]string{"user-agent", "accept"}},
		{"h2 with", "h2", &fingerprint.Shape{HeaderOrder: []string{"content-length", "user-agent", "accept"}, PseudoOrder: []string{":method", ":path", ":scheme", ":authority"}},
			[]string{"content-length", "user-agent", "accept"}},
		{"h2 no shape", "h2", nil, []string{"accept", "content-length", "user-agent"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			o.Reset()
			cc, _ := openConn(t, o, goHello(t, c.alpn), nil, Options{})
			req := newRequest(t, ctxTimeout(t, 10*time.Second), "POST", o.URL()+"/", c.shape)
			req.Header.Set("User-Agent", "curl/7.88.1")
			req.Header.Set("Accept", "*/*")
			resp, err := cc.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			rec := o.Records()[0]
			if rec.Shape == nil || !slices.Equal(rec.Shape.HeaderOrder, c.want) {
				t.Errorf("origin saw %+v, want %q", rec.Shape, c.want)
			}
		})
	}
}

// TestHTTP10RequestLine: an HTTP/1.0 client's request goes out as
// HTTP/1.0, the version it sent.
func TestHTTP10RequestLine(t *testing.T) {
	o := startOrigin(t, fporigin.Options{})
	cc, _ := openConn(t, o, goHello(t), nil, Options{})
	for i := range 2 {
		req := newRequest(t, ctxTimeout(t, 10*time.Second), "GET", o.URL()+"/", &fingerprint.Shape{HeaderOrder: []string{"User-Agent", "Host"}})
		req.Proto, req.ProtoMajor, req.ProtoMinor = "HTTP/1.0", 1, 0
		req.Header.Set("User-Agent", "curl/7.88.1")
		resp, err := cc.RoundTrip(req)
		if i == 1 {
			// An HTTP/1.0 exchange without keep-alive ends its connection.
			if err == nil {
				resp.Body.Close()
				t.Errorf("a second request went out on the HTTP/1.0 connection")
			}
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if b, _ := io.ReadAll(resp.Body); string(b) != "ok" {
			t.Errorf("body %q", b)
		}
		resp.Body.Close()
		if rec := o.Records()[0]; rec.Proto != "HTTP/1.0" {
			t.Errorf("origin saw %s, client sent HTTP/1.0", rec.Proto)
		}
	}
}
