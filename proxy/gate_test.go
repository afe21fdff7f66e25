package proxy_test

import (
	"bufio"
	"context"
	"crypto/x509"
	"encoding/base64"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/app"
	"github.com/seed-a3c387e8/onceproxy/internal/netguard"
	"github.com/seed-a3c387e8/onceproxy/proxy/ratelimit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// testUsers is one proxy user, alice, with password "right".
func testUsers() map[string]string { return map[string]string{"alice": "right"} }

// clientAs is a client whose proxy URL carries user:pass (sent preemptively
// by Go on plain requests and on CONNECT).
func (w *world) clientAs(user, pass string) *http.Client {
	pu := *w.proxyURL
	if user != "" {
		pu.User = url.UserPassword(user, pass)
	}
	c := w.client(false)
	c.Transport.(*http.Transport).Proxy = http.ProxyURL(&pu)
	return c
}

func TestProxyAuth(t *testing.T) {
	tlsO := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	plain := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{users: testUsers(), originCAs: []*x509.Certificate{tlsO.Certificate()}})

	// Plain requests: 407 with a Basic challenge without or with wrong
	// credentials, 200 with the right ones (session hints allowed).
	for _, tc := range []struct {
		user, pass string
		want       int
	}{{"", "", 407}, {"alice", "wrong", 407}, {"bob", "right", 407}, {"alice", "right", 200}, {"alice-session-s1", "right", 200}} {
		resp, body := w.get(w.clientAs(tc.user, tc.pass), plain.URL+"/p")
		if resp.StatusCode != tc.want {
			t.Fatalf("plain as %q/%q: %d %q", tc.user, tc.pass, resp.StatusCode, body)
		}
		if tc.want == 407 && resp.Header.Get("Proxy-Authenticate") != `Basic realm="onceproxy", charset="UTF-8"` {
			t.Fatalf("407 without a Basic challenge: %v", resp.Header)
		}
	}
	// CONNECT: the challenge comes on the CONNECT itself.
	for _, tc := range []struct {
		hdr  string
		want int
	}{
		{"", 407},
		{"Proxy-Authorization: Basic " + base64.StdEncoding.EncodeToString([]byte("alice:wrong")) + "\r\n", 407},
		{"Proxy-Authorization: Basic " + base64.StdEncoding.EncodeToString([]byte("alice:right")) + "\r\n", 200},
	} {
		conn, err := net.Dial("tcp", w.proxyURL.Host)
		if err != nil {
			t.Fatal(err)
		}
		host := strings.TrimPrefix(tlsO.URL, "https://")
		fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n%s\r\n", host, host, tc.hdr)
		resp, err := http.ReadResponse(bufio.NewReader(conn), &http.Request{Method: http.MethodConnect})
		conn.Close()
		if err != nil || resp.StatusCode != tc.want {
			t.Fatalf("CONNECT with %q: %v %v", tc.hdr, err, resp)
		}
		if tc.want == 407 && !strings.HasPrefix(resp.Header.Get("Proxy-Authenticate"), "Basic ") {
			t.Fatalf("CONNECT 407 without a challenge")
		}
		// goproxy closes the connection after a refusal: the answer has
		// to say so, or a client answers the challenge on a dead one.
		if tc.want == 407 && !resp.Close {
			t.Fatalf("CONNECT 407 without Connection: close: %v", resp.Header)
		}
	}
	// And a full HTTPS request through the MITM with the right credentials.
	if resp, body := w.get(w.clientAs("alice", "right"), tlsO.URL+"/s"); resp.StatusCode != 200 || !strings.Contains(body, "path=/s") {
		t.Fatalf("https with credentials: %d %q", resp.StatusCode, body)
	}
}

// TestFailedLoginsLimit: past auth.max_failures_per_minute new wrong
// credentials, the client's untried credentials get 429 with Retry-After
// instead of being checked, on plain requests and on CONNECT alike, right
// ones included; credentials it had accepted before still pass.
func TestFailedLoginsLimit(t *testing.T) {
	tlsO := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	plain := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{users: map[string]string{"alice": "right", "bob": "right2"}, authFailures: 2,
		originCAs: []*x509.Certificate{tlsO.Certificate()}})
	status := func(user, pass string) (int, *http.Response, string) {
		t.Helper()
		resp, body := w.get(w.clientAs(user, pass), plain.URL+"/p")
		return resp.StatusCode, resp, body
	}
	if code, _, body := status("alice", "right"); code != 200 {
		t.Fatalf("right password: %d %q", code, body)
	}
	for _, pw := range []string{"guess1", "guess2", "guess1"} { // the repeat is no new failure
		if code, _, body := status("alice", pw); code != 407 {
			t.Fatalf("wrong password %q under the limit: %d %q", pw, code, body)
		}
	}
	code, resp, body := status("alice", "guess3")
	if code != 429 || resp.Header.Get("Retry-After") == "" || !strings.Contains(body, "max_failures_per_minute") {
		t.Fatalf("wrong password past the limit: %d Retry-After %q %q", code, resp.Header.Get("Retry-After"), body)
	}
	if code, _, body := status("bob", "right2"); code != 429 {
		t.Fatalf("untried right password past the limit: %d %q", code, body)
	}
	if code, _, body := status("alice", "right"); code != 200 {
		t.Fatalf("accepted password past the limit: %d %q", code, body)
	}
	conn, err := net.Dial("tcp", w.proxyURL.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	host := strings.TrimPrefix(tlsO.URL, "https://")
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\nProxy-Authorization: Basic %s\r\n\r\n",
		host, host, base64.StdEncoding.EncodeToString([]byte("bob:guess4")))
	if resp, err := http.ReadResponse(bufio.NewReader(conn), &http.Request{Method: http.MethodConnect}); err != nil || resp.StatusCode != 429 || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("CONNECT past the limit: %v %v", err, resp)
	}
}

func TestRateLimitPerClient(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{users: testUsers(), rateLimit: &ratelimit.Config{Requests: 3, Window: time.Minute}})
	alice := w.clientAs("alice", "right")
	for i := range 3 {
		if resp, _ := w.get(alice, origin.URL+"/r"); resp.StatusCode != 200 {
			t.Fatalf("request %d: %d", i+1, resp.StatusCode)
		}
	}
	resp, body := w.get(alice, origin.URL+"/r")
	if resp.StatusCode != 429 || resp.Header.Get("Retry-After") == "" || resp.Header.Get("X-Onceproxy-Error") != "rate_limited" {
		t.Fatalf("over the limit: %d %v %q", resp.StatusCode, resp.Header, body)
	}
	// A session hint does not make a new client: the account is limited.
	if resp, _ := w.get(w.clientAs("alice-session-other", "right"), origin.URL+"/r"); resp.StatusCode != 429 {
		t.Fatalf("a session hint escaped the account's limit: %d", resp.StatusCode)
	}
	// Without users the client IP is the key, and another IP is another
	// client (127.0.0.2 is this machine too, as a different source).
	w2 := newWorld(t, worldOpts{rateLimit: &ratelimit.Config{Requests: 1, Window: time.Minute}})
	if resp, _ := w2.get(w2.client(false), origin.URL+"/x"); resp.StatusCode != 200 {
		t.Fatal("first request limited")
	}
	if resp, _ := w2.get(w2.client(false), origin.URL+"/x"); resp.StatusCode != 429 {
		t.Fatal("IP-keyed limit not applied")
	}
	// Nothing verifies a name here: a new one each request is the same
	// client, not a way around its limit.
	if resp, _ := w2.get(w2.clientAs("fresh-name-1", "x"), origin.URL+"/x"); resp.StatusCode != 429 {
		t.Fatalf("an unverified proxy user escaped the IP's limit: %d", resp.StatusCode)
	}
	other := w2.client(false)
	other.Transport.(*http.Transport).DialContext = (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}).DialContext
	if resp, _ := w2.get(other, origin.URL+"/x"); resp.StatusCode != 200 {
		t.Fatalf("a client from another IP was limited: %d", resp.StatusCode)
	}
	if n := w.app.Limiter.Rejected(); n != 2 {
		t.Fatalf("rejected = %d", n)
	}
}

func TestGuardRefusesPrivateTargets(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{guard: &netguard.Config{}})
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(origin.URL, "http://"))
	for _, target := range []string{
		origin.URL + "/x",
		"http://localhost:" + port + "/x",
		"http://2130706433:" + port + "/x", // 127.0.0.1 as a decimal integer
		"http://0x7f.1:" + port + "/x",
		"http://[::ffff:127.0.0.1]:" + port + "/x",
		"http://169.254.169.254/latest/meta-data/",
	} {
		resp, body := w.get(w.client(false), target)
		if resp.StatusCode != 403 || resp.Header.Get("X-Onceproxy-Error") != "forbidden_target" || !strings.Contains(body, "refusing") {
			t.Fatalf("%s: %d %q", target, resp.StatusCode, body)
		}
	}
	// CONNECT to a private target is refused before any tunnel exists.
	conn, err := net.Dial("tcp", w.proxyURL.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "CONNECT 10.0.0.1:443 HTTP/1.1\r\nHost: 10.0.0.1:443\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(conn), &http.Request{Method: http.MethodConnect})
	if err != nil || resp.StatusCode != 403 {
		t.Fatalf("CONNECT 10.0.0.1: %v %v", err, resp)
	}
	b, _ := io.ReadAll(resp.Body)
	if !strings.Contains(string(b), "private") {
		t.Fatalf("reason: %q", b)
	}
	// The allow list opens loopback for tests and local development.
	w2 := newWorld(t, worldOpts{guard: &netguard.Config{AllowCIDRs: []string{"127.0.0.1/32"}}})
	if resp, _ := w2.get(w2.client(false), origin.URL+"/ok"); resp.StatusCode != 200 {
		t.Fatalf("allowed loopback: %d", resp.StatusCode)
	}
}

// TestForbiddenSpellingsRefusedBeforeLookup: every odd spelling of a
// loopback target is refused by the early check before any name is looked
// up, on the HTTP port (plain requests and CONNECT) and for the Host of a
// request inside a tunnel; a resolver that counts lookups proves none
// happened. (TestSOCKS5RefusesForbiddenTargetsBeforeLookup covers the
// SOCKS5 port.) A permitted name goes through the same resolver.
func TestForbiddenSpellingsRefusedBeforeLookup(t *testing.T) {
	lookups := &countingLookup{}
	w := newWorld(t, worldOpts{
		guard:        &netguard.Config{},
		upstreamOpts: []upstream.Option{upstream.WithLookup(lookups.lookup)},
	})
	spellings := []string{"0x7f.1", "2130706433", "127.1", "localhost.", "foo.localhost", "017700000001", "[::ffff:127.0.0.1]"}
	for _, host := range spellings {
		// A plain request on the proxy port.
		resp, body := w.get(w.client(false), "http://"+host+":8080/x")
		if resp.StatusCode != 403 || resp.Header.Get("X-Onceproxy-Error") != "forbidden_target" {
			t.Errorf("GET http://%s: %d %q", host, resp.StatusCode, body)
		}
		// A CONNECT.
		conn, err := net.Dial("tcp", w.proxyURL.Host)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(conn, "CONNECT %s:443 HTTP/1.1\r\nHost: %s:443\r\n\r\n", host, host)
		cr, err := http.ReadResponse(bufio.NewReader(conn), &http.Request{Method: http.MethodConnect})
		conn.Close()
		if err != nil || cr.StatusCode != 403 {
			t.Errorf("CONNECT %s: %v %v", host, err, cr)
		}
		// Inside a tunnel to a name the early check lets through, a request
		// whose Host is the forbidden spelling.
		c := insideTunnel(t, w, "public.test:80", false)
		fmt.Fprintf(c, "GET /x HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", host)
		ir, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil || ir.StatusCode != 403 {
			t.Errorf("Host: %s inside a tunnel: %v %v", host, err, ir)
		}
	}
	if got := lookups.looked(); len(got) != 0 {
		t.Fatalf("names looked up for refused targets: %q", got)
	}
	// A name the guard allows is looked up through the same seam.
	if resp, _ := w.get(w.client(false), "http://public.test/x"); resp.StatusCode == 200 {
		t.Fatal("public.test answered: the counting resolver was not on the path")
	}
	if got := lookups.looked(); len(got) == 0 || got[0] != "public.test" {
		t.Fatalf("lookups after a permitted name: %q", got)
	}
}

// TestGuardReloadRetiresPooledConnections: the guard checks an address
// when it is dialled. A reload that stops allowing the address a name
// resolves to must not leave the connection pooled under the old guard
// carrying requests to it: the next request dials again and is refused.
func TestGuardReloadRetiresPooledConnections(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(origin.URL, "http://"))
	lookup := func(context.Context, string, string) ([]netip.Addr, error) {
		return []netip.Addr{netip.MustParseAddr("127.0.0.1")}, nil
	}
	var tightened atomic.Bool
	w := newWorld(t, worldOpts{
		guard:        &netguard.Config{AllowCIDRs: []string{"127.0.0.0/8"}},
		upstreamOpts: []upstream.Option{upstream.WithLookup(lookup)},
		reloaded: func(c *app.Config) {
			if tightened.Load() {
				c.Guard = netguard.Config{}
			}
		},
	})
	c := w.client(false)
	if resp, body := w.get(c, "http://origin.test:"+port+"/a"); resp.StatusCode != 200 {
		t.Fatalf("before the reload: %d %q", resp.StatusCode, body)
	}
	tightened.Store(true)
	if _, err := w.app.Reload(); err != nil {
		t.Fatal(err)
	}
	if resp, body := w.get(c, "http://origin.test:"+port+"/b"); resp.StatusCode != http.StatusForbidden {
		t.Errorf("after the guard stopped allowing 127.0.0.0/8: %d %q, want 403", resp.StatusCode, body)
	}
}
