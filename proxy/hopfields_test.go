package proxy_test

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2/hpack"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/fporigin"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// rawOrigin is an HTTP/1.1 origin on loopback that keeps every request
// head as the bytes that arrived, request line to empty line, and answers
// each with 200 "ok" on a kept-alive connection. net/http would hide what
// it is about: the spelling of header values.
type rawOrigin struct {
	ln   net.Listener
	cert *x509.Certificate // nil when plain
	mu   sync.Mutex
	wg   sync.WaitGroup
	cond chan struct{} // closed and replaced when a head arrives
	got  [][]byte
}

func startRawOrigin(t *testing.T, useTLS bool) *rawOrigin {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	o := &rawOrigin{ln: ln, cond: make(chan struct{})}
	if useTLS {
		var cert tls.Certificate
		cert, o.cert = selfSignedCert(t, "raw origin")
		o.ln = tls.NewListener(ln, &tls.Config{
			Certificates: []tls.Certificate{cert},
			NextProtos:   []string{"http/1.1"},
		})
	}
	o.wg.Go(func() {
		for {
			c, err := o.ln.Accept()
			if err != nil {
				return
			}
			o.wg.Go(func() { o.serve(c) })
		}
	})
	t.Cleanup(func() {
		ln.Close()
		o.wg.Wait()
	})
	return o
}

func (o *rawOrigin) serve(c net.Conn) {
	defer c.Close()
	br := bufio.NewReader(c)
	for {
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		var head []byte
		for {
			line, err := br.ReadSlice('\n')
			if err != nil {
				return
			}
			head = append(head, line...)
			if string(line) == "\r\n" || string(line) == "\n" {
				break
			}
		}
		o.mu.Lock()
		o.got = append(o.got, head)
		close(o.cond)
		o.cond = make(chan struct{})
		o.mu.Unlock()
		if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"); err != nil {
			return
		}
	}
}

// head waits for the origin's n-th request head (from 1).
func (o *rawOrigin) head(t *testing.T, n int) string {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		o.mu.Lock()
		if len(o.got) >= n {
			h := string(o.got[n-1])
			o.mu.Unlock()
			return h
		}
		cond := o.cond
		o.mu.Unlock()
		select {
		case <-cond:
		case <-deadline:
			t.Fatalf("the origin never saw request %d", n)
		}
	}
}

// headerLines returns a head's field lines, the request line left out.
func headerLines(head string) string {
	_, fields, _ := strings.Cut(head, "\r\n")
	return fields
}

// sendRawDirect writes head on a new connection to the origin (plain or TLS,
// offering http/1.1) and reads the answer.
func sendRawDirect(t *testing.T, o *rawOrigin, head string) {
	t.Helper()
	var c net.Conn
	var err error
	if o.cert != nil {
		pool := x509.NewCertPool()
		pool.AddCert(o.cert)
		c, err = tls.Dial("tcp", o.ln.Addr().String(), &tls.Config{RootCAs: pool, NextProtos: []string{"http/1.1"}, ServerName: "127.0.0.1"})
	} else {
		c, err = net.Dial("tcp", o.ln.Addr().String())
	}
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rawH1(t, c, bufio.NewReader(c), head)
}

// sendRawProxyPort writes head (origin form) to the proxy port in
// absolute form, for host, and reads the answer.
func sendRawProxyPort(t *testing.T, w *world, host, head string) {
	t.Helper()
	c, err := net.Dial("tcp", w.proxyURL.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	head = strings.Replace(head, " /", " http://"+host+"/", 1)
	rawH1(t, c, bufio.NewReader(c), head)
}

// sendRawTunnel writes head inside a CONNECT tunnel to host, TLS or not,
// and reads the answer.
func sendRawTunnel(t *testing.T, w *world, host, head string, useTLS bool) {
	t.Helper()
	c := insideTunnel(t, w, host, useTLS)
	rawH1(t, c, bufio.NewReader(c), head)
}

// TestConnectionSpellingReachesTheOrigin: an HTTP/1.1 client's
// "Connection: Keep-Alive" (.NET's and old Java's spelling) reaches an
// HTTP/1.1 origin spelled as the client spelled it, on the proxy port in
// absolute form and inside plain and TLS tunnels: the origin sees the same
// header lines as from the client directly.
func TestConnectionSpellingReachesTheOrigin(t *testing.T) {
	plain := startRawOrigin(t, false)
	secure := startRawOrigin(t, true)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{secure.cert}})
	for _, value := range []string{"Keep-Alive", "keep-alive", "close"} {
		fields := "Host: %s\r\nUser-Agent: raw/1\r\nAccept: */*\r\nConnection: " + value + "\r\n\r\n"
		for _, tc := range []struct {
			name   string
			origin *rawOrigin
			send   func(host, head string)
		}{
			{"proxy port", plain, func(host, head string) { sendRawProxyPort(t, w, host, head) }},
			{"plain tunnel", plain, func(host, head string) { sendRawTunnel(t, w, host, head, false) }},
			{"tls tunnel", secure, func(host, head string) { sendRawTunnel(t, w, host, head, true) }},
		} {
			t.Run(tc.name+"/"+value, func(t *testing.T) {
				host := tc.origin.ln.Addr().String()
				head := "GET /x HTTP/1.1\r\n" + strings.Replace(fields, "%s", host, 1)
				tc.origin.mu.Lock()
				n := len(tc.origin.got)
				tc.origin.mu.Unlock()
				sendRawDirect(t, tc.origin, head)
				want := headerLines(tc.origin.head(t, n+1))
				tc.send(host, head)
				got := headerLines(tc.origin.head(t, n+2))
				if got != want {
					t.Errorf("origin saw\n%s\nthrough onceproxy; directly\n%s", got, want)
				}
			})
		}
	}
	// Options naming fields the proxy removed go with them; those left
	// keep their spelling.
	t.Run("hop field named", func(t *testing.T) {
		host := secure.ln.Addr().String()
		c := insideTunnel(t, w, host, true)
		rawH1(t, c, bufio.NewReader(c), "GET /named HTTP/1.1\r\nHost: "+host+"\r\nX-Hop: 1\r\nConnection: Keep-Alive, X-Hop\r\n\r\n")
		secure.mu.Lock()
		n := len(secure.got)
		secure.mu.Unlock()
		want := "Host: " + host + "\r\nConnection: Keep-Alive\r\n\r\n"
		if got := headerLines(secure.head(t, n)); got != want {
			t.Errorf("origin saw\n%s\nwant\n%s", got, want)
		}
	})
}

// TestTETrailersReachesTheOrigin: "TE: trailers" (Firefox, gRPC clients)
// reaches the origin as from the client directly: over HTTP/2, where it
// is the one TE value allowed (RFC 9113 §8.2.2), and over HTTP/1.1 with
// the "TE" option of its Connection field (RFC 9110 §10.1.4). Other
// transfer codings the client would accept are the proxy's connection's
// business and stay behind.
func TestTETrailersReachesTheOrigin(t *testing.T) {
	t.Run("h2", func(t *testing.T) {
		origin := startFPOrigin(t, fporigin.Options{})
		w := newWorld(t, worldOpts{upstream: upstream.Config{CAFiles: []string{origin.CAFile()}}})
		base := "https://localhost:" + origin.Port()
		mustFetch(t, goFPClient(t, nil, origin.CertPool(), true, nil), base+"/te-direct", "Te", "trailers")
		mustFetch(t, goFPClient(t, w.proxyURL, w.caPool, true, nil), base+"/te-proxied", "Te", "trailers")
		want, got := recordOf(t, origin, "/te-direct"), recordOf(t, origin, "/te-proxied")
		if got.Proto != "HTTP/2.0" || fmt.Sprint(got.Header["Te"]) != fmt.Sprint(want.Header["Te"]) ||
			!slices.Equal(got.Shape.HeaderOrder, want.Shape.HeaderOrder) {
			t.Errorf("origin saw %s te %q, order %q; directly %s te %q, order %q", got.Proto, got.Header["Te"],
				got.Shape.HeaderOrder, want.Proto, want.Header["Te"], want.Shape.HeaderOrder)
		}
	})
	t.Run("h1", func(t *testing.T) {
		origin := startRawOrigin(t, true)
		w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.cert}})
		host := origin.ln.Addr().String()
		head := "GET /te HTTP/1.1\r\nHost: " + host + "\r\nUser-Agent: raw/1\r\nTE: trailers\r\nConnection: keep-alive, TE\r\n\r\n"
		sendRawDirect(t, origin, head)
		want := headerLines(origin.head(t, 1))
		c := insideTunnel(t, w, host, true)
		rawH1(t, c, bufio.NewReader(c), head)
		if got := headerLines(origin.head(t, 2)); got != want {
			t.Errorf("origin saw\n%s\nthrough onceproxy; directly\n%s", got, want)
		}
		// Only trailers: gzip here is the client's offer to the proxy.
		rawH1(t, c, bufio.NewReader(c), strings.Replace(head, "TE: trailers", "TE: gzip;q=0.5, trailers", 1))
		if got := headerLines(origin.head(t, 3)); got != want {
			t.Errorf("origin saw\n%s\nwant\n%s", got, want)
		}
	})
	// An HTTP/2 client (Firefox sends "te: trailers" last) at an origin
	// that speaks HTTP/1.1 only: its request is translated, and over
	// HTTP/1.1 TE goes with the TE option of a Connection field (RFC 9110
	// §10.1.4), which HTTP/2 has no room for.
	t.Run("h2 client at an h1 origin", func(t *testing.T) {
		origin := startRawOrigin(t, true)
		w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.cert}})
		host := origin.ln.Addr().String()
		h2Get(t, w, host, []hpack.HeaderField{
			{Name: ":method", Value: "GET"}, {Name: ":path", Value: "/te-h2"}, {Name: ":authority", Value: host},
			{Name: ":scheme", Value: "https"}, {Name: "user-agent", Value: "Mozilla/5.0 test"},
			{Name: "accept", Value: "*/*"}, {Name: "te", Value: "trailers"},
		})
		want := "Host: " + host + "\r\nUser-Agent: Mozilla/5.0 test\r\nAccept: */*\r\nTe: trailers\r\nConnection: TE\r\n\r\n"
		if got := headerLines(origin.head(t, 1)); got != want {
			t.Errorf("origin saw\n%s\nwant\n%s", got, want)
		}
	})
}

// TestNoMadeUpConnectionField: a client whose Connection field names only
// what the proxy removed (curl --http2's "Upgrade, HTTP2-Settings" on an
// http:// URL, a TE the origin is not sent, an HTTP/1.0 client's own
// field) reaches the origin with no Connection field at all, as the same
// client would without those fields: nothing of what it listed holds for
// the origin, and a "keep-alive" or "close" in its place is a field the
// client never sent.
func TestNoMadeUpConnectionField(t *testing.T) {
	plain := startRawOrigin(t, false)
	secure := startRawOrigin(t, true)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{secure.cert}})
	for _, tc := range []struct {
		name, line, fields, want string
	}{
		{"h2c upgrade", "GET /h2c HTTP/1.1",
			"Host: %s\r\nUser-Agent: curl/8.14.1\r\nAccept: */*\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n",
			"Host: %s\r\nUser-Agent: curl/8.14.1\r\nAccept: */*\r\n\r\n"},
		{"te without trailers", "GET /te HTTP/1.1",
			"Host: %s\r\nUser-Agent: raw/1\r\nTE: gzip\r\nConnection: TE\r\n\r\n",
			"Host: %s\r\nUser-Agent: raw/1\r\n\r\n"},
		{"http/1.0 hop field", "GET /10 HTTP/1.0",
			"Host: %s\r\nUser-Agent: raw/1\r\nX-Hop: 1\r\nConnection: X-Hop\r\n\r\n",
			"Host: %s\r\nUser-Agent: raw/1\r\n\r\n"},
	} {
		for _, door := range []struct {
			name   string
			origin *rawOrigin
			send   func(host, head string)
		}{
			{"proxy port", plain, func(host, head string) { sendRawProxyPort(t, w, host, head) }},
			{"tls tunnel", secure, func(host, head string) { sendRawTunnel(t, w, host, head, true) }},
		} {
			t.Run(tc.name+"/"+door.name, func(t *testing.T) {
				host := door.origin.ln.Addr().String()
				door.origin.mu.Lock()
				n := len(door.origin.got)
				door.origin.mu.Unlock()
				door.send(host, tc.line+"\r\n"+strings.Replace(tc.fields, "%s", host, 1))
				want := strings.Replace(tc.want, "%s", host, 1)
				if got := headerLines(door.origin.head(t, n+1)); got != want {
					t.Errorf("origin saw\n%s\nwant\n%s", got, want)
				}
			})
		}
	}
}

// TestTETrailersThroughNetHTTP: requests net/http sends for the proxy
// (fingerprint: go; also plain http behind an HTTP gateway, WebSocket
// handshakes, GET /fetch) carry "TE: trailers" as the mirror does: over
// HTTP/1.1 with the TE option of a Connection field when the client
// listed it, or spoke HTTP/2 where it has no Connection field; over
// HTTP/2 without, where net/http refuses any Connection field but
// keep-alive or close.
func TestTETrailersThroughNetHTTP(t *testing.T) {
	h1 := startRawOrigin(t, true)
	h2 := startFPOrigin(t, fporigin.Options{})
	w := newWorld(t, worldOpts{
		originCAs: []*x509.Certificate{h1.cert},
		upstream:  upstream.Config{Fingerprint: upstream.FingerprintGo, CAFiles: []string{h2.CAFile()}},
	})
	host := h1.ln.Addr().String()
	t.Run("h1 client", func(t *testing.T) {
		c := insideTunnel(t, w, host, true)
		rawH1(t, c, bufio.NewReader(c), "GET /te-go HTTP/1.1\r\nHost: "+host+"\r\nUser-Agent: raw/1\r\nTE: trailers\r\nConnection: keep-alive, TE\r\n\r\n")
		got := h1.head(t, 1)
		if !strings.Contains(got, "\r\nTe: trailers\r\n") || !strings.Contains(got, "\r\nConnection: TE\r\n") {
			t.Errorf("origin saw\n%s\nwant Te: trailers with Connection: TE", got)
		}
		// Without the option the client sent none, and none is made up.
		rawH1(t, c, bufio.NewReader(c), "GET /te-go-alone HTTP/1.1\r\nHost: "+host+"\r\nUser-Agent: raw/1\r\nTE: trailers\r\n\r\n")
		if got := h1.head(t, 2); !strings.Contains(got, "\r\nTe: trailers\r\n") || strings.Contains(got, "Connection") {
			t.Errorf("origin saw\n%s\nwant Te: trailers alone", got)
		}
	})
	t.Run("h2 client at an h1 origin", func(t *testing.T) {
		mustFetch(t, goFPClient(t, w.proxyURL, w.caPool, true, nil), "https://"+host+"/te-go-h2", "Te", "trailers")
		got := h1.head(t, 3)
		if !strings.Contains(got, "\r\nTe: trailers\r\n") || !strings.Contains(got, "\r\nConnection: TE\r\n") {
			t.Errorf("origin saw\n%s\nwant Te: trailers with Connection: TE", got)
		}
	})
	t.Run("h2 client at an h2 origin", func(t *testing.T) {
		mustFetch(t, goFPClient(t, w.proxyURL, w.caPool, true, nil), "https://localhost:"+h2.Port()+"/te-go-h2", "Te", "trailers")
		got := recordOf(t, h2, "/te-go-h2")
		if got.Proto != "HTTP/2.0" || fmt.Sprint(got.Header["Te"]) != "[trailers]" || got.Header["Connection"] != nil {
			t.Errorf("origin saw %s te %q connection %q, want HTTP/2.0 te [trailers] and no connection",
				got.Proto, got.Header["Te"], got.Header["Connection"])
		}
	})
}
