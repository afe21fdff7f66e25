package proxy_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	xproxy "golang.org/x/net/proxy"

	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// hintWorld is a proxy with user alice (password "right") in front of two
// upstream sessions whose ids hold '-' and '.', plus a TLS and a plain
// origin, and the SOCKS5 port.
func hintWorld(t *testing.T) (w *world, tlsURL, plainURL string) {
	t.Helper()
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	tlsO := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	plain := plainOrigin(t, http.HandlerFunc(echoProto))
	w = newWorld(t, worldOpts{
		originCAs: []*x509.Certificate{tlsO.Certificate()},
		upstream: upstream.Config{Sessions: []upstream.SessionConfig{
			{ID: "eu-1", URL: fp.URL("s1", "http")},
			{ID: "us.2", URL: fp.URL("s2", "http")},
		}},
		users:  testUsers(),
		socks5: &socks.Config{},
	})
	return w, tlsO.URL, plain.URL
}

// socks5HTTPClient goes through the world's SOCKS5 port as user/pass and
// trusts onceproxy's CA.
func (w *world) socks5HTTPClient(user, pass string) *http.Client {
	tr := &http.Transport{
		Proxy:           http.ProxyURL(&url.URL{Scheme: "socks5", Host: w.socksAddr, User: url.UserPassword(user, pass)}),
		TLSClientConfig: &tls.Config{RootCAs: w.caPool},
	}
	w.t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: time.Minute}
}

// TestSessionIDsWithDashesAndDots: an id that upstream.sessions accepts
// (eu-1, us.2) is accepted wherever a client names a session: the
// X-Onceproxy-Session header and the end of the proxy user name, on plain
// requests, inside intercepted tunnels and on the SOCKS5 port. The session
// that answered says so in X-Onceproxy-Upstream.
func TestSessionIDsWithDashesAndDots(t *testing.T) {
	w, tlsURL, plainURL := hintWorld(t)
	for _, u := range []string{plainURL + "/p", tlsURL + "/s"} {
		for _, tc := range []struct {
			user, header, want string
		}{
			{"alice-session-eu-1", "", "eu-1"},
			{"alice-sessid-us.2", "", "us.2"},
			{"alice", "eu-1", "eu-1"},
			{"alice-session-eu-1", "us.2", "us.2"}, // the header wins
		} {
			// Several rounds: without the hint the pool picks at random.
			for range 8 {
				var hdr []string
				if tc.header != "" {
					hdr = []string{"X-Onceproxy-Session", tc.header}
				}
				resp, body := w.get(w.clientAs(tc.user, "right"), u, hdr...)
				if resp.StatusCode != 200 || resp.Header.Get(upstream.HeaderUpstream) != tc.want {
					t.Fatalf("%s as %q, header %q: %d via %q, want 200 via %s: %q", u, tc.user, tc.header,
						resp.StatusCode, resp.Header.Get(upstream.HeaderUpstream), tc.want, body)
				}
			}
		}
		for range 8 {
			resp, body := w.get(w.socks5HTTPClient("alice-session-eu-1", "right"), u)
			if resp.StatusCode != 200 || resp.Header.Get(upstream.HeaderUpstream) != "eu-1" {
				t.Fatalf("SOCKS5 %s: %d via %q: %q", u, resp.StatusCode, resp.Header.Get(upstream.HeaderUpstream), body)
			}
		}
	}
}

// TestBadSessionHintIs400: a session the proxy cannot parse (bad
// characters, too long, empty) is refused with the reason, never dropped
// in favour of a random session: 400 on the HTTP port and on the CONNECT,
// 400 for a bad header inside a tunnel, and a failing reply (with the
// reason in the log) on the SOCKS5 port.
func TestBadSessionHintIs400(t *testing.T) {
	w, tlsURL, plainURL := hintWorld(t)
	long := strings.Repeat("x", 65)
	for _, u := range []string{plainURL + "/p", tlsURL + "/s"} {
		for _, tc := range []struct{ header, want string }{
			{"bad/id", `"bad/id"`},
			{long, "64"},
			{"eu 1", `"eu 1"`},
		} {
			resp, body := w.get(w.clientAs("alice", "right"), u, "X-Onceproxy-Session", tc.header)
			if resp.StatusCode != 400 || !strings.Contains(body, "X-Onceproxy-Session") || !strings.Contains(body, tc.want) {
				t.Errorf("%s with header %q: %d %q, want 400 naming the header and %s", u, tc.header, resp.StatusCode, body, tc.want)
			}
		}
	}
	// The user name on a plain request.
	for _, user := range []string{"alice-session-", "alice-session-bad/id", "alice-sessid-" + long} {
		resp, body := w.get(w.clientAs(user, "right"), plainURL+"/p")
		if resp.StatusCode != 400 || !strings.Contains(body, "session") {
			t.Errorf("plain as %q: %d %q, want 400 with the reason", user, resp.StatusCode, body)
		}
	}
	// The user name on a CONNECT: refused before any tunnel exists.
	host := strings.TrimPrefix(tlsURL, "https://")
	for _, user := range []string{"alice-session-", "alice-session-bad/id"} {
		conn, err := net.Dial("tcp", w.proxyURL.Host)
		if err != nil {
			t.Fatal(err)
		}
		cred := base64.StdEncoding.EncodeToString([]byte(user + ":right"))
		fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\nProxy-Authorization: Basic %s\r\n\r\n", host, host, cred)
		resp, err := http.ReadResponse(bufio.NewReader(conn), &http.Request{Method: http.MethodConnect})
		conn.Close()
		if err != nil || resp.StatusCode != 400 {
			t.Errorf("CONNECT as %q: %v %v, want 400", user, err, resp)
		}
	}
	// A wrong password still gets the 407 first: the hint is judged once
	// the client is known.
	if resp, _ := w.get(w.clientAs("alice-session-", "wrong"), plainURL+"/p"); resp.StatusCode != 407 {
		t.Errorf("bad hint, wrong password: %d, want 407", resp.StatusCode)
	}
	// SOCKS5: the CONNECT gets a failing reply, and the log says why.
	d, err := xproxy.SOCKS5("tcp", w.socksAddr, &xproxy.Auth{User: "alice-session-bad/id", Password: "right"}, xproxy.Direct)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if c, err := d.(xproxy.ContextDialer).DialContext(ctx, "tcp", host); err == nil {
		c.Close()
		t.Error("SOCKS5 CONNECT with a bad session hint succeeded")
	}
	testkit.Eventually(t, 10*time.Second, func() bool {
		return strings.Contains(w.logs.String(), `bad/id`)
	}, "the SOCKS5 refusal and its reason in the log")
	// And the proxy still serves good hints.
	if resp, _ := w.get(w.clientAs("alice-session-eu-1", "right"), plainURL+"/p"); resp.StatusCode != 200 {
		t.Fatalf("after the refusals: %d", resp.StatusCode)
	}
}
