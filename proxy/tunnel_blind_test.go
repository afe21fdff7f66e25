package proxy_test

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/ratelimit"
)

// TestConnectNonHTTPBlindTunnelsAreRateLimited: a CONNECT tunnel whose
// client speaks neither TLS nor HTTP is dialled blind upstream, exactly as
// a bypass CONNECT or a SOCKS5 blind tunnel is, and those count as one
// request each for the client's rate limit. This one must too: with a
// limit of 2, the third such tunnel must not reach its target.
func TestConnectNonHTTPBlindTunnelsAreRateLimited(t *testing.T) {
	w := newWorld(t, worldOpts{
		proxy:     proxy.Config{ReadHeaderTimeout: 2 * time.Second},
		rateLimit: &ratelimit.Config{Requests: 2, Window: time.Minute},
	})
	echo := echoServer(t, "", "")
	for i := range 3 {
		conn, br := connectTunnel(t, w, echo)
		_ = conn.SetDeadline(time.Now().Add(3 * time.Second))
		io.WriteString(conn, "SSH-2.0-OpenSSH_9.6\r\n")
		line, err := bufio.NewReader(br).ReadString('\n')
		conn.Close()
		reached := err == nil && line == "SSH-2.0-OpenSSH_9.6\r\n"
		if i < 2 && !reached {
			t.Fatalf("tunnel %d within the limit: %q, %v", i+1, line, err)
		}
		if i == 2 && reached {
			t.Fatal("a third blind tunnel within a rate limit of 2 reached its target: the limit is not applied to the HTTP door's non-HTTP tunnels")
		}
	}
}

// TestConnectNonHTTPBlindTunnelHalfClose: the client of a non-HTTP
// tunnel half-closes after its request; the answer the server sends after
// that EOF must still reach it.
func TestConnectNonHTTPBlindTunnelHalfClose(t *testing.T) {
	w := newWorld(t, worldOpts{proxy: proxy.Config{ReadHeaderTimeout: 2 * time.Second}})
	echo := echoServer(t, "", "BYE")
	conn, br := connectTunnel(t, w, echo)
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	io.WriteString(conn, "SSH-2.0-OpenSSH_9.6\r\n")
	if err := conn.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(br)
	if string(got) != "SSH-2.0-OpenSSH_9.6\r\nBYE" {
		t.Fatalf("got %q, %v", got, err)
	}
}

// clientHelloFor returns the raw ClientHello record crypto/tls sends for
// serverName.
func clientHelloFor(t *testing.T, serverName string) []byte {
	t.Helper()
	c1, c2 := net.Pipe()
	defer c2.Close()
	go func() {
		_ = tls.Client(c1, &tls.Config{ServerName: serverName, InsecureSkipVerify: true}).Handshake()
		c1.Close()
	}()
	hdr := make([]byte, 5)
	if _, err := io.ReadFull(c2, hdr); err != nil {
		t.Fatal(err)
	}
	body := make([]byte, int(hdr[3])<<8|int(hdr[4]))
	if _, err := io.ReadFull(c2, body); err != nil {
		t.Fatal(err)
	}
	return append(hdr, body...)
}

// TestFullyQualifiedSNIGoesThroughBlind: a client whose SNI is a fully
// qualified name ("www.example.co.", as OpenSSL sends what it is given)
// is answered by origins (OpenSSL, nginx), so the MITM must answer it
// too; crypto/tls refuses such a hello outright.
func TestFullyQualifiedSNIGoesThroughBlind(t *testing.T) {
	w := newWorld(t, worldOpts{proxy: proxy.Config{ReadHeaderTimeout: 3 * time.Second}})
	// A stand-in origin on loopback that takes any hello: it answers a
	// record of type handshake, as an OpenSSL origin answers this one.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				if _, err := c.Read(make([]byte, 1)); err == nil {
					c.Write([]byte{0x16, 0x03, 0x03, 0x00, 0x00})
				}
			}()
		}
	}()
	for _, tc := range []struct{ name, from, to string }{
		{"plain name", "", ""},
		{"trailing dot", "example.com", "example.co."}, // same length: no length to fix up
	} {
		t.Run(tc.name, func(t *testing.T) {
			hello := clientHelloFor(t, "www.example.com")
			if tc.from != "" {
				hello = bytes.Replace(hello, []byte(tc.from), []byte(tc.to), 1)
			}
			conn, br := connectTunnel(t, w, ln.Addr().String())
			defer conn.Close()
			_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err := conn.Write(hello); err != nil {
				t.Fatal(err)
			}
			first, err := br.ReadByte()
			if err != nil || first != 0x16 {
				t.Fatalf("the MITM answered the hello with record type %#x (%v), want a ServerHello (0x16); 0x15 is an alert", first, err)
			}
		})
	}
}

// TestNonHTTPALPNGoesThroughBlind: a TLS client that offers only
// protocols other than HTTP (MQTT, IMAP, PostgreSQL's direct TLS, ACME's
// tls-alpn-01) has nothing for the MITM to serve: intercepted, it got a
// certificate from the proxy's CA and then an HTTP loop that answers its
// protocol with a 400. Its tunnel goes to the target blind, so it meets
// the origin's own certificate and protocol.
func TestNonHTTPALPNGoesThroughBlind(t *testing.T) {
	w := newWorld(t, worldOpts{proxy: proxy.Config{ReadHeaderTimeout: 3 * time.Second}})
	origin := httptest.NewUnstartedServer(nil)
	origin.TLS = &tls.Config{NextProtos: []string{"mqtt"}}
	origin.Config.TLSNextProto = map[string]func(*http.Server, *tls.Conn, http.Handler){
		"mqtt": func(_ *http.Server, c *tls.Conn, _ http.Handler) {
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			_, _ = io.Copy(c, c)
		},
	}
	origin.StartTLS()
	defer origin.Close()
	roots := x509.NewCertPool()
	roots.AddCert(origin.Certificate())

	conn, br := connectTunnel(t, w, origin.Listener.Addr().String())
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	tc := tls.Client(&bufConn{Conn: conn, r: br}, &tls.Config{ServerName: "example.com", RootCAs: roots, NextProtos: []string{"mqtt"}})
	if err := tc.Handshake(); err != nil {
		t.Fatalf("handshake through the tunnel: %v (the MITM took a non-HTTP TLS client)", err)
	}
	if p := tc.ConnectionState().NegotiatedProtocol; p != "mqtt" {
		t.Fatalf("negotiated %q, want the origin's mqtt", p)
	}
	io.WriteString(tc, "\x10\x0c\x00\x04MQTT")
	got := make([]byte, 8)
	if _, err := io.ReadFull(tc, got); err != nil || string(got) != "\x10\x0c\x00\x04MQTT" {
		t.Fatalf("echo: %q, %v", got, err)
	}
}
