package proxy_test

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/fporigin"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// The tests here hold two leaks the README's fingerprint limits own up
// to, so that the README stays true: when one of them fails, the leak was
// fixed, and the README should say so.

// TestResumptionNeverReachesTheOrigin: a Go client with a session cache
// resumes its TLS sessions with an origin it reaches directly; through
// onceproxy every origin connection is a full handshake.
func TestResumptionNeverReachesTheOrigin(t *testing.T) {
	var mu sync.Mutex
	resumed := map[string]bool{}
	s := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		resumed[r.URL.Path] = r.TLS.DidResume
		mu.Unlock()
		w.Header().Set("Connection", "close") // a new origin connection for every request
		io.WriteString(w, "ok")
	}))
	s.StartTLS() // session tickets on, as crypto/tls has them by default
	t.Cleanup(s.Close)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{s.Certificate()}})
	origin := x509.NewCertPool()
	origin.AddCert(s.Certificate())
	run := func(name string, proxy *url.URL, roots *x509.CertPool) {
		tr := &http.Transport{DisableKeepAlives: true,
			TLSClientConfig: &tls.Config{RootCAs: roots, ClientSessionCache: tls.NewLRUClientSessionCache(8)}}
		if proxy != nil {
			tr.Proxy = http.ProxyURL(proxy)
		}
		c := &http.Client{Transport: tr, Timeout: time.Minute}
		for i := range 2 {
			mustFetch(t, c, fmt.Sprintf("%s/%s-%d", s.URL, name, i))
		}
	}
	run("direct", nil, origin)
	run("proxied", w.proxyURL, w.caPool)
	mu.Lock()
	defer mu.Unlock()
	if !resumed["/direct-1"] {
		t.Fatal("the client did not resume directly: the test shows nothing")
	}
	if resumed["/proxied-0"] || resumed["/proxied-1"] {
		t.Errorf("an origin connection through onceproxy resumed (%v): update the README's limits", resumed)
	}
}

// TestH2ClientAtAnH1Origin: a client that offers h2 and http/1.1 gets
// HTTP/2 from onceproxy the first time, before any client's connection
// has shown what the origin speaks (the MITM answers ALPN before the
// origin is dialled): an origin that speaks only HTTP/1.1 then gets an
// HTTP/1.1 request translated from the HTTP/2 one, the client's HTTP/2
// header order behind Host, names canonical, and no Connection field.
// From then on the MITM offers such a client what the origin chose, and
// its HTTP/1.1 request reaches the origin as the client wrote it. An
// origin that negotiates no protocol at all is answered likewise, and
// one that speaks HTTP/2 still gets HTTP/2.
func TestH2ClientAtAnH1Origin(t *testing.T) {
	h1Only := startFPOrigin(t, fporigin.Options{NextProtos: []string{"http/1.1"}})
	noALPN := startFPOrigin(t, fporigin.Options{NextProtos: []string{}})
	h2 := startFPOrigin(t, fporigin.Options{})
	w := newWorld(t, worldOpts{upstream: upstream.Config{CAFiles: []string{h1Only.CAFile(), noALPN.CAFile(), h2.CAFile()}}})

	fields := func(host, path string) []hpack.HeaderField {
		return []hpack.HeaderField{
			{Name: ":method", Value: "GET"}, {Name: ":authority", Value: host}, {Name: ":scheme", Value: "https"},
			{Name: ":path", Value: path}, {Name: "sec-ch-ua", Value: `"Chromium";v="141"`},
			{Name: "user-agent", Value: "Mozilla/5.0 test"}, {Name: "accept", Value: "*/*"},
			{Name: "sec-fetch-site", Value: "none"}, {Name: "accept-language", Value: "en"},
		}
	}
	h2Get(t, w, "localhost:"+h1Only.Port(), fields("localhost:"+h1Only.Port(), "/h2-client"))
	got := recordOf(t, h1Only, "/h2-client")
	want := []string{"Host", "Sec-Ch-Ua", "User-Agent", "Accept", "Sec-Fetch-Site", "Accept-Language"}
	if got.Proto != "HTTP/1.1" || !slices.Equal(got.Shape.HeaderOrder, want) {
		t.Errorf("first connection: origin saw %s with %q, want HTTP/1.1 with %q: if it changed, update the README's limits",
			got.Proto, got.Shape.HeaderOrder, want)
	}

	for _, c := range []struct {
		name   string
		origin *fporigin.Origin
		alpn   string // what onceproxy answers the client from now on
	}{
		{"h1-only", h1Only, "http/1.1"},
		{"no-alpn", noALPN, ""},
		{"h2", h2, "h2"},
	} {
		t.Run(c.name, func(t *testing.T) {
			host := "localhost:" + c.origin.Port()
			if c.origin != h1Only {
				// Its first connection (HTTP/2, as for h1Only above),
				// which shows the proxy what the origin speaks.
				h2Get(t, w, host, fields(host, "/first"))
				recordOf(t, c.origin, "/first")
			}
			order := []string{"Host", "user-agent", "Accept", "X-Custom", "accept-language"}
			p := h1Get(t, w, host, "/second", order)
			if p != c.alpn {
				t.Fatalf("onceproxy answered ALPN %q to a client offering h2 and http/1.1, want %q", p, c.alpn)
			}
			if c.alpn == "h2" {
				return
			}
			got := recordOf(t, c.origin, "/second")
			if got.Proto != "HTTP/1.1" || !slices.Equal(withoutHop(got.Shape.HeaderOrder), order) {
				t.Errorf("origin saw %s with %q, want HTTP/1.1 with %q, the client's own order and case",
					got.Proto, got.Shape.HeaderOrder, order)
			}
		})
	}
}

// h1Get opens a tunnel to host with a hello offering h2 and http/1.1 and
// returns the protocol onceproxy chose. Unless it chose h2, it sends an
// HTTP/1.1 GET for path with the fields of order (Host's value is host;
// the others' are made up), in that order and case, and reads the
// response.
func h1Get(t *testing.T, w *world, host, path string, order []string) string {
	t.Helper()
	conn, br := connectTunnel(t, w, host)
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(15 * time.Second))
	name, _, _ := net.SplitHostPort(host)
	tc := tls.Client(&bufConn{Conn: conn, r: br}, &tls.Config{RootCAs: w.caPool, ServerName: name, NextProtos: []string{"h2", "http/1.1"}})
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	proto := tc.ConnectionState().NegotiatedProtocol
	if proto == "h2" {
		return proto
	}
	var req strings.Builder
	fmt.Fprintf(&req, "GET %s HTTP/1.1\r\n", path)
	for _, f := range order {
		v := "v-" + strings.ToLower(f)
		if f == "Host" {
			v = host
		}
		fmt.Fprintf(&req, "%s: %s\r\n", f, v)
	}
	req.WriteString("\r\n")
	if _, err := io.WriteString(tc, req.String()); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(tc), nil)
	if err != nil {
		t.Fatalf("%s%s: %v", host, path, err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s%s: status %d", host, path, resp.StatusCode)
	}
	return proto
}

// h2Get sends one HTTP/2 request with exactly these fields, in this
// order, through a tunnel to host (which must answer h2 at onceproxy),
// and waits for the response head.
func h2Get(t *testing.T, w *world, host string, fields []hpack.HeaderField) {
	t.Helper()
	conn, br := connectTunnel(t, w, host)
	t.Cleanup(func() { conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(15 * time.Second))
	name, _, _ := net.SplitHostPort(host)
	tc := tls.Client(&bufConn{Conn: conn, r: br}, &tls.Config{RootCAs: w.caPool, ServerName: name, NextProtos: []string{"h2", "http/1.1"}})
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	if p := tc.ConnectionState().NegotiatedProtocol; p != "h2" {
		t.Fatalf("onceproxy answered ALPN %q", p)
	}
	if _, err := io.WriteString(tc, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(tc, tc)
	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	for _, f := range fields {
		enc.WriteField(f)
	}
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block.Bytes(), EndStream: true, EndHeaders: true}); err != nil {
		t.Fatal(err)
	}
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatal(err)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				fr.WriteSettingsAck()
			}
		case *http2.HeadersFrame:
			if f.StreamID == 1 {
				return
			}
		case *http2.RSTStreamFrame:
			t.Fatalf("stream reset: %v", f.ErrCode)
		case *http2.GoAwayFrame:
			t.Fatalf("GOAWAY: %v", f.ErrCode)
		}
	}
}
