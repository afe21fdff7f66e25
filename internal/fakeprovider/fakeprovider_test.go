package fakeprovider_test

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	xproxy "golang.org/x/net/proxy"

	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
)

// whoami is an origin that answers with the caller's IP.
func whoami(t *testing.T) *httptest.Server {
	t.Helper()
	o := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		io.WriteString(w, host)
	}))
	t.Cleanup(o.Close)
	return o
}

func clientVia(t *testing.T, proxyURL string) *http.Client {
	t.Helper()
	u, err := url.Parse(proxyURL)
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{Proxy: http.ProxyURL(u), DisableKeepAlives: true}
	if u.Scheme == "socks5" {
		d, err := xproxy.FromURL(u, &net.Dialer{})
		if err != nil {
			t.Fatal(err)
		}
		tr.Proxy = nil
		tr.DialContext = d.(xproxy.ContextDialer).DialContext
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 5 * time.Second}
}

func getBody(t *testing.T, c *http.Client, u string) (int, string) {
	t.Helper()
	resp, err := c.Get(u)
	if err != nil {
		t.Fatalf("GET %s: %v", u, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestGatewaysExitFromTheSessionIP(t *testing.T) {
	p := fakeprovider.Start(t, fakeprovider.Options{Sessions: 3})
	plain := whoami(t)
	tlsO := httptest.NewTLSServer(plain.Config.Handler)
	defer tlsO.Close()
	seen := map[string]bool{}
	for _, s := range p.Sessions() {
		if seen[s.ExitIP] {
			t.Fatalf("two sessions share exit IP %s", s.ExitIP)
		}
		seen[s.ExitIP] = true
		for _, scheme := range []string{"http", "socks5"} {
			c := clientVia(t, p.URL(s.ID, scheme))
			if _, ip := getBody(t, c, plain.URL); ip != s.ExitIP {
				t.Errorf("%s %s plain: origin saw %s, want %s", s.ID, scheme, ip, s.ExitIP)
			}
			// https goes through CONNECT (or the SOCKS5 tunnel).
			tr := c.Transport.(*http.Transport)
			tr.TLSClientConfig = tlsO.Client().Transport.(*http.Transport).TLSClientConfig
			if _, ip := getBody(t, c, tlsO.URL); ip != s.ExitIP {
				t.Errorf("%s %s tls: origin saw %s, want %s", s.ID, scheme, ip, s.ExitIP)
			}
		}
	}
	if got := p.Requests("s1"); got != 4 {
		t.Errorf("Requests(s1) = %d, want 4", got)
	}
}

func TestGatewayChecksCredentials(t *testing.T) {
	p := fakeprovider.Start(t, fakeprovider.Options{})
	o := whoami(t)
	bad := strings.Replace(p.URL("s1", "http"), "acct-session-s1:", "acct-session-s1:wrong", 1)
	resp, err := clientVia(t, bad).Get(o.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusProxyAuthRequired {
		t.Fatalf("wrong password: %d, want 407", resp.StatusCode)
	}
	badSocks := strings.Replace(p.URL("s1", "socks5"), "acct-session-s1:", "acct-session-s1:wrong", 1)
	if _, err := clientVia(t, badSocks).Get(o.URL); err == nil {
		t.Fatal("socks5 with a wrong password succeeded")
	}
}

func TestRotationModes(t *testing.T) {
	o := whoami(t)
	t.Run("per_request", func(t *testing.T) {
		p := fakeprovider.Start(t, fakeprovider.Options{Rotation: fakeprovider.PerRequest})
		c := clientVia(t, p.URL("s1", "http"))
		prev := ""
		for i := range 5 {
			_, ip := getBody(t, c, o.URL)
			if ip == prev {
				t.Fatalf("request %d left from %s again", i, ip)
			}
			prev = ip
		}
	})
	t.Run("timed", func(t *testing.T) {
		var mu sync.Mutex
		now := time.Unix(1000, 0)
		clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
		p := fakeprovider.Start(t, fakeprovider.Options{Rotation: fakeprovider.Timed, Interval: time.Minute, Now: clock})
		c := clientVia(t, p.URL("s1", "http"))
		_, a := getBody(t, c, o.URL)
		_, b := getBody(t, c, o.URL)
		mu.Lock()
		now = now.Add(61 * time.Second)
		mu.Unlock()
		_, d := getBody(t, c, o.URL)
		if a != b || d == a {
			t.Fatalf("timed: %s %s then after the interval %s", a, b, d)
		}
	})
	t.Run("rotate", func(t *testing.T) {
		p := fakeprovider.Start(t, fakeprovider.Options{})
		c := clientVia(t, p.URL("s1", "http"))
		_, a := getBody(t, c, o.URL)
		ip, err := p.Rotate("s1")
		if err != nil {
			t.Fatal(err)
		}
		_, b := getBody(t, c, o.URL)
		if b == a || b != ip || p.Rotations("s1") != 1 {
			t.Fatalf("rotate: %s → %s (Rotate said %s, %d rotations)", a, b, ip, p.Rotations("s1"))
		}
	})
}

func apiDo(t *testing.T, p *fakeprovider.Provider, method, path, key string) (int, []byte) {
	t.Helper()
	req, _ := http.NewRequest(method, p.APIURL()+path, nil)
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	c := &http.Client{Timeout: 500 * time.Millisecond}
	resp, err := c.Do(req)
	if err != nil {
		return 0, []byte(err.Error())
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

func TestAPI(t *testing.T) {
	p := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2, APIKey: "k3y"})
	if st, _ := apiDo(t, p, "GET", "/api/session", ""); st != 401 {
		t.Fatalf("no bearer: %d, want 401", st)
	}
	if st, _ := apiDo(t, p, "GET", "/api/session", "nope"); st != 401 {
		t.Fatalf("wrong bearer: %d, want 401", st)
	}
	st, body := apiDo(t, p, "GET", "/api/session", "k3y")
	var list struct{ Sessions []fakeprovider.Wire }
	if st != 200 || json.Unmarshal(body, &list) != nil || len(list.Sessions) != 2 {
		t.Fatalf("list: %d %s", st, body)
	}
	w := list.Sessions[0]
	if w.ID != "s1" || w.Username == "" || w.Password == "" || w.GatewayHost != "127.0.0.1" ||
		w.HTTPPort == 0 || w.SOCKS5Port == 0 || w.Rotation != "sticky" || w.ExitIP == "" {
		t.Fatalf("wire session incomplete: %+v", w)
	}
	st, body = apiDo(t, p, "POST", "/api/session/s1/rotate", "k3y")
	var rotated fakeprovider.Wire
	if st != 200 || json.Unmarshal(body, &rotated) != nil || rotated.ExitIP == w.ExitIP || p.Rotations("s1") != 1 {
		t.Fatalf("rotate: %d %s (was %s)", st, body, w.ExitIP)
	}
	if st, _ := apiDo(t, p, "POST", "/api/session/zz/rotate", "k3y"); st != 404 {
		t.Fatalf("rotate unknown: %d, want 404", st)
	}

	p.SetAPIMode(fakeprovider.APIGarbage)
	if st, body := apiDo(t, p, "GET", "/api/session", "k3y"); st != 200 || json.Valid(body) {
		t.Fatalf("garbage mode: %d %s", st, body)
	}
	p.SetAPIMode(fakeprovider.API500)
	if st, _ := apiDo(t, p, "GET", "/api/session", "k3y"); st != 500 {
		t.Fatalf("500 mode: %d", st)
	}
	p.SetAPIMode(fakeprovider.APIEmpty)
	if _, body := apiDo(t, p, "GET", "/api/session", "k3y"); !strings.Contains(string(body), `"sessions":[]`) {
		t.Fatalf("empty mode: %s", body)
	}
	p.SetAPIMode(fakeprovider.APIHang)
	if st, _ := apiDo(t, p, "GET", "/api/session", "k3y"); st != 0 {
		t.Fatalf("hang mode answered %d", st)
	}
	p.SetAPIMode(fakeprovider.APIOK)
	if st, _ := apiDo(t, p, "GET", "/api/session", "k3y"); st != 200 {
		t.Fatalf("back to OK: %d", st)
	}
	if p.APICalls() != 10 {
		t.Errorf("APICalls = %d, want 10", p.APICalls())
	}
}

func TestGatewayModes(t *testing.T) {
	p := fakeprovider.Start(t, fakeprovider.Options{})
	o := whoami(t)
	tlsO := httptest.NewTLSServer(o.Config.Handler)
	defer tlsO.Close()
	c := clientVia(t, p.URL("s1", "http"))
	c.Timeout = 500 * time.Millisecond
	socks := clientVia(t, p.URL("s1", "socks5"))
	socks.Timeout = 500 * time.Millisecond

	p.SetMode("s1", fakeprovider.Mode429)
	if st, _ := getBody(t, c, o.URL); st != 429 {
		t.Errorf("429 mode, absolute-form: %d", st)
	}
	if _, err := c.Get(tlsO.URL); err == nil || !strings.Contains(err.Error(), "Too Many Requests") {
		t.Errorf("429 mode, CONNECT: %v", err)
	}
	if _, err := socks.Get(o.URL); err == nil {
		t.Error("429 mode, socks5: no error")
	}
	p.SetMode("s1", fakeprovider.Mode502)
	if st, _ := getBody(t, c, o.URL); st != 502 {
		t.Errorf("502 mode: %d", st)
	}
	p.SetMode("s1", fakeprovider.ModeRefuse)
	if _, err := c.Get(o.URL); err == nil {
		t.Error("refuse mode: no error")
	}
	if _, err := socks.Get(o.URL); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Errorf("refuse mode, socks5: %v", err)
	}
	p.SetMode("s1", fakeprovider.ModeHang)
	if _, err := c.Get(o.URL); err == nil {
		t.Error("hang mode: answered")
	}
	if _, err := socks.Get(o.URL); err == nil {
		t.Error("hang mode, socks5: answered")
	}
	p.SetMode("s1", fakeprovider.ModeOK)
	if st, _ := getBody(t, c, o.URL); st != 200 {
		t.Errorf("OK again: %d", st)
	}
}

func TestConnsCountsConnections(t *testing.T) {
	p := fakeprovider.Start(t, fakeprovider.Options{})
	o := whoami(t)
	u, _ := url.Parse(p.URL("s1", "http"))
	keep := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(u)}}
	defer keep.CloseIdleConnections()
	for range 5 {
		getBody(t, keep, o.URL)
	}
	if p.Conns("s1") != 1 || p.Requests("s1") != 5 {
		t.Fatalf("keep-alive: conns %d requests %d, want 1 and 5", p.Conns("s1"), p.Requests("s1"))
	}
	fresh := clientVia(t, p.URL("s1", "http"))
	for range 3 {
		getBody(t, fresh, o.URL)
	}
	if p.Conns("s1") != 4 {
		t.Fatalf("no keep-alive: conns %d, want 4", p.Conns("s1"))
	}
}

// TestCloseCutsEverything: tunnels open and a request hanging, Close
// returns and leaves no goroutine behind.
func TestCloseCutsEverything(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	o := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	defer o.Close()
	p, err := fakeprovider.New(fakeprovider.Options{Sessions: 2})
	if err != nil {
		t.Fatal(err)
	}
	// An open CONNECT tunnel and an open SOCKS5 tunnel.
	for _, scheme := range []string{"http", "socks5"} {
		u, _ := url.Parse(p.URL("s1", scheme))
		var c net.Conn
		if scheme == "socks5" {
			d, _ := xproxy.FromURL(u, &net.Dialer{})
			c, err = d.(xproxy.ContextDialer).DialContext(context.Background(), "tcp", o.Listener.Addr().String())
		} else {
			c, err = net.Dial("tcp", u.Host)
			if err == nil {
				pass, _ := u.User.Password()
				target := o.Listener.Addr().String()
				fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\nProxy-Authorization: Basic %s\r\n\r\n",
					target, target, base64.StdEncoding.EncodeToString([]byte(u.User.Username()+":"+pass)))
				var resp *http.Response
				if resp, err = http.ReadResponse(bufio.NewReader(c), nil); err == nil && resp.StatusCode != 200 {
					t.Fatalf("CONNECT: %s", resp.Status)
				}
			}
		}
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	p.SetMode("s2", fakeprovider.ModeHang)
	hung := make(chan struct{})
	go func() {
		defer close(hung)
		u, _ := url.Parse(p.URL("s2", "http"))
		tr := &http.Transport{Proxy: http.ProxyURL(u)}
		defer tr.CloseIdleConnections()
		resp, err := (&http.Client{Transport: tr}).Get(o.URL)
		if err == nil {
			resp.Body.Close()
		}
	}()
	if n := p.Requests("s1"); n != 2 {
		t.Fatalf("Requests(s1) = %d, want 2 open tunnels", n)
	}
	p.Close()
	<-hung
}

func TestBlockRefusesTheTargetOnly(t *testing.T) {
	p := fakeprovider.Start(t, fakeprovider.Options{})
	o, other := whoami(t), whoami(t)
	tlsO := httptest.NewTLSServer(o.Config.Handler)
	defer tlsO.Close()
	p.Block(strings.TrimPrefix(o.URL, "http://"))
	p.Block(strings.TrimPrefix(tlsO.URL, "https://"))
	c := clientVia(t, p.URL("s1", "http"))
	socks := clientVia(t, p.URL("s1", "socks5"))
	if st, _ := getBody(t, c, o.URL); st != http.StatusForbidden {
		t.Errorf("blocked target, absolute-form: %d", st)
	}
	if _, err := c.Get(tlsO.URL); err == nil || !strings.Contains(err.Error(), "Forbidden") {
		t.Errorf("blocked target, CONNECT: %v", err)
	}
	if _, err := socks.Get(o.URL); err == nil || !strings.Contains(err.Error(), "not allowed by ruleset") {
		t.Errorf("blocked target, socks5: %v", err)
	}
	for _, cl := range []*http.Client{c, socks} {
		if st, _ := getBody(t, cl, other.URL); st != http.StatusOK {
			t.Errorf("another target: %d", st)
		}
	}
}
