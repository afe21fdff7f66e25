package fporigin

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
)

func start(t *testing.T, opts Options) *Origin {
	t.Helper()
	o, err := Start(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { o.Close() })
	return o
}

func get(t *testing.T, c *http.Client, url string) {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if b, _ := io.ReadAll(resp.Body); resp.StatusCode != 200 || string(b) != "ok" {
		t.Fatalf("GET %s: %s %q", url, resp.Status, b)
	}
}

// TestRecordsGoClients: the origin serves and records Go's client over
// HTTP/1.1 and HTTP/2, each request with the connection it came on.
func TestRecordsGoClients(t *testing.T) {
	o := start(t, Options{})
	for _, h2 := range []bool{false, true} {
		o.Reset()
		tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: o.CertPool()}, ForceAttemptHTTP2: h2}
		c := &http.Client{Transport: tr}
		get(t, c, "https://localhost:"+o.Port()+"/a?x=1")
		get(t, c, "https://localhost:"+o.Port()+"/b")
		tr.CloseIdleConnections()
		recs := o.Records()
		if len(recs) != 2 {
			t.Fatalf("h2=%v: %d records", h2, len(recs))
		}
		r := recs[0]
		wantProto, wantALPN := "HTTP/1.1", ""
		if h2 {
			wantProto, wantALPN = "HTTP/2.0", "h2"
		}
		if r.Proto != wantProto || r.ALPN != wantALPN || !r.TLS || r.TLSVersion != tls.VersionTLS13 {
			t.Errorf("h2=%v: proto %s alpn %q tls %v %x", h2, r.Proto, r.ALPN, r.TLS, r.TLSVersion)
		}
		if r.Path != "/a?x=1" || r.Host != "localhost:"+o.Port() || recs[1].Conn != r.Conn {
			t.Errorf("h2=%v: records %+v", h2, recs)
		}
		if r.Hello == nil || r.Hello.ServerName != "localhost" || !strings.HasPrefix(r.JA4, "t13d") || r.JA3 == "" {
			t.Errorf("h2=%v: hello %v JA4 %s", h2, r.Hello != nil, r.JA4)
		}
		if r.Shape == nil || !slices.Contains(r.Shape.HeaderOrder, "User-Agent") && !slices.Contains(r.Shape.HeaderOrder, "user-agent") {
			t.Errorf("h2=%v: shape %+v", h2, r.Shape)
		}
		if h2 != (r.H2 != nil) || h2 && r.Akamai != "2:0;4:4194304;5:16384;6:10485760|1073741824|0|a,m,p,s" {
			t.Errorf("h2=%v: preface %+v %q", h2, r.H2, r.Akamai)
		}
	}
}

// TestRecordsRawHTTP1Case: header names are recorded as sent, case and
// order included; plain HTTP works too.
func TestRecordsRawHTTP1Case(t *testing.T) {
	for _, plain := range []bool{false, true} {
		o := start(t, Options{Plain: plain})
		var conn interface {
			io.ReadWriter
			Close() error
		}
		var err error
		if plain {
			conn, err = dialPlain(o.Addr())
		} else {
			conn, err = tls.Dial("tcp", o.Addr(), &tls.Config{RootCAs: o.CertPool(), ServerName: "localhost"})
		}
		if err != nil {
			t.Fatal(err)
		}
		io.WriteString(conn, "GET /x HTTP/1.1\r\nuser-AGENT: me\r\nHost: o\r\nX-Z: 1\r\naccept: */*\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		conn.Close()
		recs, err := o.Wait(ctxTimeout(t), 1)
		if err != nil {
			t.Fatal(err)
		}
		want := []string{"user-AGENT", "Host", "X-Z", "accept"}
		if got := recs[0].Shape; got == nil || !slices.Equal(got.HeaderOrder, want) {
			t.Errorf("plain=%v: shape %+v, want %q", plain, got, want)
		}
		if recs[0].TLS == plain || (recs[0].Hello == nil) != plain {
			t.Errorf("plain=%v: TLS %v hello %v", plain, recs[0].TLS, recs[0].Hello != nil)
		}
	}
}

func TestRefuse(t *testing.T) {
	refused := errors.New("no thanks")
	o := start(t, Options{Refuse: func(h *fingerprint.ClientHello) error {
		if h.ServerName == "refused.test" {
			return refused
		}
		return nil
	}, Hosts: []string{"refused.test", "ok.test"}})
	if _, err := tls.Dial("tcp", o.Addr(), &tls.Config{RootCAs: o.CertPool(), ServerName: "refused.test"}); err == nil {
		t.Error("a refused hello completed its handshake")
	}
	c, err := tls.Dial("tcp", o.Addr(), &tls.Config{RootCAs: o.CertPool(), ServerName: "ok.test"})
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
}

func ctxTimeout(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func dialPlain(addr string) (net.Conn, error) { return net.Dial("tcp", addr) }
