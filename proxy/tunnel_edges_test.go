package proxy_test

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	xproxy "golang.org/x/net/proxy"

	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/ratelimit"
	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
)

// TestMITMWithoutACommonProtocol: a client whose ALPN list holds none of
// the MITM's protocols (curl --http1.0 offers only "http/1.0") completes
// its handshake, as with a server that does not negotiate, and gets an
// HTTP answer; Go's default would refuse the handshake.
func TestMITMWithoutACommonProtocol(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{})
	host := strings.TrimPrefix(origin.URL, "http://")
	conn, _ := connectTunnel(t, w, "localhost:443")
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(15 * time.Second))
	tc := tls.Client(conn, &tls.Config{RootCAs: w.caPool, ServerName: "localhost", NextProtos: []string{"http/1.0"}})
	if err := tc.Handshake(); err != nil {
		t.Fatalf("handshake offering only http/1.0: %v", err)
	}
	if p := tc.ConnectionState().NegotiatedProtocol; p != "" {
		t.Fatalf("negotiated %q, want none", p)
	}
	// Absolute-form to a plain origin: answered whatever the tunnel's
	// target, so the answer is the proxy's, over HTTP/1.0.
	fmt.Fprintf(tc, "GET %s/alpn HTTP/1.0\r\nHost: %s\r\n\r\n", origin.URL, host)
	resp, err := http.ReadResponse(bufio.NewReader(tc), nil)
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	resp.Body.Close()
}

// TestTunnelHostWithoutPort: a request in a tunnel whose Host names the
// tunnel's host without a port goes to the tunnel's port, where the
// client's bytes were headed, not to the scheme's default port.
func TestTunnelHostWithoutPort(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{})
	target := strings.TrimPrefix(origin.URL, "http://")
	conn, br := connectTunnel(t, w, target)
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(15 * time.Second))
	fmt.Fprint(conn, "GET /portless HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
	resp := readAnswers(t, br, "GET")[0]
	if body := bodyOf(resp); resp.StatusCode != 200 || !strings.Contains(body, "path=/portless") {
		t.Fatalf("got %d %q", resp.StatusCode, body)
	}
}

// TestSOCKS5BlindTunnelsAreRateLimited: a SOCKS5 tunnel dialled blind (a
// bypass host) is one request for the client's rate limit, as a bypass
// CONNECT is, and the one over the limit is refused with reply 0x02.
func TestSOCKS5BlindTunnelsAreRateLimited(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{
		proxy:     proxy.Config{BypassHosts: []string{"127.0.0.1"}},
		socks5:    socksOn(socks.Config{AllowNoAuth: true}),
		rateLimit: &ratelimit.Config{Requests: 2, Window: time.Minute},
	})
	d, err := xproxy.SOCKS5("tcp", w.socksAddr, nil, xproxy.Direct)
	if err != nil {
		t.Fatal(err)
	}
	target := strings.TrimPrefix(origin.URL, "http://")
	for i := range 3 {
		c, err := d.Dial("tcp", target)
		if i < 2 {
			if err != nil {
				t.Fatalf("tunnel %d: %v", i+1, err)
			}
			c.Close()
			continue
		}
		if err == nil {
			c.Close()
			t.Fatal("a third blind tunnel within the limit of 2")
		}
		if !strings.Contains(err.Error(), "not allowed by ruleset") {
			t.Fatalf("tunnel over the limit: %v, want reply 0x02", err)
		}
	}
}
