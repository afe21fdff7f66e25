package proxy_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/netguard"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/ratelimit"
	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// mqttOrigin is a loopback TLS service that speaks only MQTT (its ALPN),
// echoing what it reads, and counts the connections it accepts.
func mqttOrigin(t *testing.T) (addr string, roots *x509.CertPool, accepted *atomic.Int64) {
	t.Helper()
	accepted = new(atomic.Int64)
	origin := httptest.NewUnstartedServer(nil)
	origin.TLS = &tls.Config{NextProtos: []string{"mqtt"}}
	origin.Config.ErrorLog = log.New(io.Discard, "", 0) // the connection made for nothing
	origin.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			accepted.Add(1)
		}
	}
	origin.Config.TLSNextProto = map[string]func(*http.Server, *tls.Conn, http.Handler){
		"mqtt": func(_ *http.Server, c *tls.Conn, _ http.Handler) {
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			_, _ = io.Copy(c, c)
		},
	}
	origin.StartTLS()
	t.Cleanup(origin.Close)
	roots = x509.NewCertPool()
	roots.AddCert(origin.Certificate())
	return origin.Listener.Addr().String(), roots, accepted
}

// mqttOver speaks MQTT over TLS on c, a tunnel to an mqttOrigin, and
// checks that the origin itself answered: its certificate, its protocol,
// its echo.
func mqttOver(t *testing.T, c net.Conn, roots *x509.CertPool) {
	t.Helper()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	tc := tls.Client(c, &tls.Config{ServerName: "example.com", RootCAs: roots, NextProtos: []string{"mqtt"}})
	if err := tc.Handshake(); err != nil {
		t.Fatalf("handshake through the tunnel: %v", err)
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

// TestNonHTTPTLSIsDialledOnce: a TLS client that offers no HTTP protocol
// goes to its target blind, through either door, and its tunnel is one
// dial: one connection at the origin, one request for the rate limit (2
// here, so two such tunnels pass). On the SOCKS5 door, to a port outside
// mitm_ports (dialled before the client is sniffed), it was two: the door
// dialled, found TLS, dropped that connection (the origin saw it open and
// close empty) and handed the stream to the MITM, which found the hello
// not HTTP and dialled again, and took from the rate limit again.
func TestNonHTTPTLSIsDialledOnce(t *testing.T) {
	for _, door := range []string{"socks5 other port", "socks5 mitm port", "connect"} {
		t.Run(door, func(t *testing.T) {
			addr, roots, accepted := mqttOrigin(t)
			_, port, _ := net.SplitHostPort(addr)
			p, _ := strconv.Atoi(port)
			sc := socks.Config{AllowNoAuth: true}
			if door == "socks5 mitm port" {
				sc.MITMPorts = []int{p}
			}
			w := newWorld(t, worldOpts{
				proxy:     proxy.Config{ReadHeaderTimeout: 3 * time.Second},
				rateLimit: &ratelimit.Config{Requests: 2, Window: time.Minute},
				socks5:    &sc,
			})
			for i := int64(1); i <= 2; i++ {
				var c net.Conn
				if door == "connect" {
					conn, br := connectTunnel(t, w, addr)
					c = &bufConn{Conn: conn, r: br}
				} else {
					r := dialRaw(t, w)
					r.greet(0)
					if code := r.request(1, "127.0.0.1", p); code != 0 {
						t.Fatalf("tunnel %d of 2 within the rate limit: reply %d (the first one took from the limit twice?)", i, code)
					}
					c = r.c
				}
				mqttOver(t, c, roots)
				c.Close()
				time.Sleep(100 * time.Millisecond) // a connection made for nothing has been accepted by now
				if got := accepted.Load(); got != i {
					t.Errorf("the origin accepted %d connections for %d tunnels", got, i)
				}
			}
		})
	}
}

// TestConnectBlindDialTimeRefusalIsCounted: a CONNECT tunnel that turns
// out not to be HTTP is dialled blind, and a name that passed the early
// check but resolves to a forbidden address (DNS rebinding) is refused at
// that dial. The refusal is counted in onceproxy_ssrf_refused_total as the
// same refusal is on a bypass CONNECT or the SOCKS5 door: this path dialled
// on its own, past the count.
func TestConnectBlindDialTimeRefusalIsCounted(t *testing.T) {
	lookup := func(context.Context, string, string) ([]netip.Addr, error) {
		return []netip.Addr{netip.MustParseAddr("127.0.0.1")}, nil
	}
	w := newWorld(t, worldOpts{
		proxy:        proxy.Config{ReadHeaderTimeout: 3 * time.Second},
		upstreamOpts: []upstream.Option{upstream.WithLookup(lookup)},
		guard:        &netguard.Config{},
	})
	conn, br := connectTunnel(t, w, "rebind.test:9999")
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	io.WriteString(conn, "SSH-2.0-OpenSSH_9.6\r\n")
	if b, err := io.ReadAll(br); len(b) > 0 || err != nil {
		t.Fatalf("the refused tunnel answered %q, %v; want it closed", b, err)
	}
	if got := w.metricLine("onceproxy_ssrf_refused_total"); got != "onceproxy_ssrf_refused_total 1" {
		t.Fatalf("metrics: %q, want the refusal counted once", got)
	}
}
