package e2e

import (
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// curlResult is what one curl run reports through --write-out.
type curlResult struct {
	Body, Code, Version, Connect, XCache, Upstream, Exit string
}

const curlWriteOut = "\n@@code=%{http_code}@@version=%{http_version}@@connect=%{http_connect}" +
	"@@xcache=%header{x-cache}@@upstream=%header{x-onceproxy-upstream}@@exit=%{exitcode}"

// curl runs curl (no ~/.curlrc, quiet but with errors, a deadline) with env
// and args, and parses what it wrote out. A curl failure is in Exit.
func curl(t *testing.T, env []string, args ...string) curlResult {
	t.Helper()
	bin := needClient(t, "curl", "apt-get install curl")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	all := append([]string{"-q", "-sS", "--max-time", "20", "-w", curlWriteOut}, args...)
	out, err := runCmd(t, ctx, nil, cleanEnv(env...), bin, all...)
	s := string(out)
	i := strings.LastIndex(s, "\n@@code=")
	if i < 0 {
		t.Fatalf("curl %s: no write-out in %q: %v", strings.Join(args, " "), s, err)
	}
	r := curlResult{Body: s[:i]}
	for _, f := range strings.Split(s[i+1:], "@@") {
		k, v, _ := strings.Cut(f, "=")
		switch k {
		case "code":
			r.Code = v
		case "version":
			r.Version = v
		case "connect":
			r.Connect = v
		case "xcache":
			r.XCache = v
		case "upstream":
			r.Upstream = v
		case "exit":
			r.Exit = v
		}
	}
	return r
}

// wantOK checks a curl run got the origin's 200 through onceproxy.
func (r curlResult) wantOK(t *testing.T, what, xcache string) {
	t.Helper()
	if r.Exit != "0" || r.Code != "200" || !strings.HasPrefix(r.Body, "hello over HTTP/") {
		t.Errorf("%s: exit %s, status %s, body %q", what, r.Exit, r.Code, r.Body)
	}
	if r.XCache != xcache {
		t.Errorf("%s: X-Cache %q, want %q", what, r.XCache, xcache)
	}
}

// TestCurlHTTPProxy: the README's first recipe, curl -x with --cacert; the
// second identical request is a HIT; a plain http:// URL goes through the
// proxy too; without --cacert curl refuses onceproxy's certificate.
func TestCurlHTTPProxy(t *testing.T) {
	o := startOrigin(t, 0)
	p := startProxy(t, o.CAFile, proxyOpts{})
	u := o.URL + "/hello"
	curl(t, nil, "-x", p.URL("", ""), "--cacert", p.CAFile, u).wantOK(t, "curl -x --cacert", "MISS")
	curl(t, nil, "-x", p.URL("", ""), "--cacert", p.CAFile, u).wantOK(t, "the same again", "HIT")
	curl(t, nil, "-x", p.URL("", ""), o.Plain+"/hello").wantOK(t, "curl -x http://", "MISS")
	if r := curl(t, nil, "-x", p.URL("", ""), u); r.Exit != "60" {
		t.Errorf("without --cacert: exit %s, want 60 (certificate problem)", r.Exit)
	}
	if n := o.countByPath()["/hello"]; n != 2 {
		t.Errorf("origin got /hello %d times, want 2 (HTTPS once, plain once)", n)
	}
	p.assertLoopbackOnly(t)
}

// TestCurlProxyEnv: the variable forms. curl reads https_proxy and
// HTTPS_PROXY for https:// URLs, but only the lower-case http_proxy for
// http:// URLs (HTTP_PROXY is ignored, so that request goes direct and
// carries no X-Cache).
func TestCurlProxyEnv(t *testing.T) {
	o := startOrigin(t, 0)
	p := startProxy(t, o.CAFile, proxyOpts{})
	px := p.URL("", "")
	curl(t, []string{"https_proxy=" + px}, "--cacert", p.CAFile, o.URL+"/hello").wantOK(t, "https_proxy", "MISS")
	curl(t, []string{"HTTPS_PROXY=" + px}, "--cacert", p.CAFile, o.URL+"/hello").wantOK(t, "HTTPS_PROXY", "HIT")
	curl(t, []string{"http_proxy=" + px}, o.Plain+"/hello").wantOK(t, "http_proxy", "MISS")
	if r := curl(t, []string{"HTTP_PROXY=" + px}, o.Plain+"/hello"); r.Exit != "0" || r.XCache != "" {
		t.Errorf("HTTP_PROXY: exit %s, X-Cache %q; curl should ignore it and go direct", r.Exit, r.XCache)
	}
	p.assertLoopbackOnly(t)
}

// TestCurlHTTP2: HTTP/2 between curl and onceproxy's MITM (ALPN h2), and
// HTTP/1.1 when asked.
func TestCurlHTTP2(t *testing.T) {
	o := startOrigin(t, 0)
	p := startProxy(t, o.CAFile, proxyOpts{})
	r := curl(t, nil, "--http2", "-x", p.URL("", ""), "--cacert", p.CAFile, o.URL+"/hello")
	r.wantOK(t, "--http2", "MISS")
	if r.Version != "2" {
		t.Errorf("--http2: HTTP version %q, want 2", r.Version)
	}
	r = curl(t, nil, "--http1.1", "-x", p.URL("", ""), "--cacert", p.CAFile, o.URL+"/hello")
	r.wantOK(t, "--http1.1", "HIT")
	if r.Version != "1.1" {
		t.Errorf("--http1.1: HTTP version %q, want 1.1", r.Version)
	}
	p.assertLoopbackOnly(t)
}

// TestCurlSOCKS5: --socks5-hostname with RFC 1929 credentials (users are
// configured), and the socks5h:// proxy URL form; the name is resolved by
// onceproxy, the stream goes through the MITM and dedup like the HTTP port.
// Without credentials the handshake fails. With no users configured (the
// shipped defaults) no credentials are needed.
func TestCurlSOCKS5(t *testing.T) {
	o := startOrigin(t, 0)
	open := startProxy(t, o.CAFile, proxyOpts{})
	curl(t, nil, "--socks5-hostname", open.SOCKSAddr, "--cacert", open.CAFile, o.URL+"/hello").
		wantOK(t, "--socks5-hostname without users", "MISS")
	p := startProxy(t, o.CAFile, proxyOpts{auth: true})
	cred := proxyUser + ":" + proxyPassword
	curl(t, nil, "--socks5-hostname", cred+"@"+p.SOCKSAddr, "--cacert", p.CAFile, o.URL+"/hello").
		wantOK(t, "--socks5-hostname user:pass@", "MISS")
	curl(t, nil, "-x", "socks5h://"+cred+"@"+p.SOCKSAddr, "--cacert", p.CAFile, o.URL+"/hello").
		wantOK(t, "-x socks5h://user:pass@", "HIT")
	curl(t, nil, "--socks5-hostname", cred+"@"+p.SOCKSAddr, o.Plain+"/hello").
		wantOK(t, "plain http:// over SOCKS5", "MISS")
	if r := curl(t, nil, "--socks5-hostname", p.SOCKSAddr, "--cacert", p.CAFile, o.URL+"/hello"); r.Exit == "0" {
		t.Errorf("SOCKS5 without credentials got through: %+v", r)
	}
	if r := curl(t, nil, "--socks5-hostname", proxyUser+":wrong@"+p.SOCKSAddr, "--cacert", p.CAFile, o.URL+"/hello"); r.Exit == "0" {
		t.Errorf("SOCKS5 with a wrong password got through: %+v", r)
	}
	p.assertLoopbackOnly(t)
}

// TestCurlProxyAuthAndSessionUser: the README's authentication recipe
// (curl sends the credentials at once) and session stickiness through the
// user name: alice-session-eu-1 authenticates as alice and names session
// eu-1; with no upstream configured the answer says X-Onceproxy-Upstream:
// direct. Which session a hint picks is proven in the proxy package's
// tests. A wrong or missing password gets the 407 challenge, a session the
// proxy cannot parse a 400.
func TestCurlProxyAuthAndSessionUser(t *testing.T) {
	o := startOrigin(t, 0)
	p := startProxy(t, o.CAFile, proxyOpts{auth: true})
	curl(t, nil, "-x", p.URL(proxyUser, proxyPassword), "--cacert", p.CAFile, o.URL+"/hello").
		wantOK(t, "-x http://alice:pw@", "MISS")
	r := curl(t, nil, "-x", p.URL(proxyUser+"-session-eu-1", proxyPassword), "--cacert", p.CAFile, o.URL+"/data/1")
	if r.Exit != "0" || r.Code != "200" || r.Upstream != "direct" || r.XCache != "MISS" {
		t.Errorf("alice-session-eu-1: %+v; want 200, MISS, X-Onceproxy-Upstream direct", r)
	}
	// Plain http:// carries Proxy-Authorization on the request itself.
	r = curl(t, nil, "-x", p.URL(proxyUser+"-session-eu-1", proxyPassword), o.Plain+"/data/1")
	if r.Code != "200" || r.Upstream != "direct" {
		t.Errorf("plain http:// as alice-session-eu-1: %+v", r)
	}
	// The SOCKS5 port takes the same user names.
	curl(t, nil, "--socks5-hostname", proxyUser+"-session-eu-1:"+proxyPassword+"@"+p.SOCKSAddr, "--cacert", p.CAFile, o.URL+"/hello").
		wantOK(t, "SOCKS5 as alice-session-eu-1", "HIT")

	for _, c := range []struct{ what, proxy string }{
		{"wrong password", p.URL(proxyUser, "wrong")},
		{"no credentials", p.URL("", "")},
	} {
		r := curl(t, nil, "-x", c.proxy, "--cacert", p.CAFile, o.URL+"/hello")
		if r.Exit == "0" || r.Connect != "407" {
			t.Errorf("%s over CONNECT: %+v; want the 407 challenge", c.what, r)
		}
		r = curl(t, nil, "-x", c.proxy, o.Plain+"/hello")
		if r.Code != "407" {
			t.Errorf("%s on plain http://: %+v; want 407", c.what, r)
		}
	}
	bad := p.URL(proxyUser+"-session-", proxyPassword)
	if r := curl(t, nil, "-x", bad, "--cacert", p.CAFile, o.URL+"/hello"); r.Exit == "0" || r.Connect != "400" {
		t.Errorf("empty session over CONNECT: %+v; want 400", r)
	}
	if r := curl(t, nil, "-x", bad, o.Plain+"/hello"); r.Code != "400" {
		t.Errorf("empty session on plain http://: %+v; want 400", r)
	}
	// Log lines reach the file in batches, 50 ms late at most.
	var users map[string]int
	logged := func() bool {
		users = map[string]int{}
		for _, rec := range p.accessLog() {
			u, _ := rec["user"].(string)
			users[u]++
		}
		return users[proxyUser] > 0 && users[proxyUser+"-session-eu-1"] >= 3
	}
	if !testkit.Poll(testkit.Patience, logged) {
		t.Errorf("access log users %v", users)
	}
	p.assertLoopbackOnly(t)
}

// TestCurlAdminAPI runs the README's admin API recipes: stats, invalidating
// a URL (the next request is a MISS again), the CA download and health.
func TestCurlAdminAPI(t *testing.T) {
	o := startOrigin(t, 0)
	p := startProxy(t, o.CAFile, proxyOpts{})
	admin := "http://" + p.AdminAddr
	curl(t, nil, "-x", p.URL("", ""), "--cacert", p.CAFile, o.URL+"/hello").wantOK(t, "first", "MISS")
	curl(t, nil, "-x", p.URL("", ""), "--cacert", p.CAFile, o.URL+"/hello").wantOK(t, "second", "HIT")

	var st struct {
		Instance stats `json:"instance"`
	}
	if err := json.Unmarshal([]byte(curl(t, nil, "-s", admin+"/cache/stats").Body), &st); err != nil {
		t.Fatalf("curl /cache/stats: %v", err)
	}
	if st.Instance.XCache["HIT"] != 1 || st.Instance.XCache["MISS"] != 1 || st.Instance.SavingsPct != 50 {
		t.Errorf("/cache/stats: %+v", st.Instance)
	}
	inv := curl(t, nil, "-s", "-X", "POST", admin+"/cache/invalidate", "-d", `{"url": "`+o.URL+`/hello"}`)
	var res struct {
		Invalidated int `json:"invalidated"`
	}
	if err := json.Unmarshal([]byte(inv.Body), &res); err != nil || inv.Code != "200" || res.Invalidated < 1 {
		t.Errorf("invalidate: %+v (%v)", inv, err)
	}
	curl(t, nil, "-x", p.URL("", ""), "--cacert", p.CAFile, o.URL+"/hello").wantOK(t, "after invalidate", "MISS")

	ca, err := os.ReadFile(p.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	if got := curl(t, nil, "-s", admin+"/ca.pem").Body; got != string(ca) {
		t.Errorf("curl /ca.pem differs from %s", p.CAFile)
	}
	if got := curl(t, nil, "-s", admin+"/health"); got.Code != "200" || !strings.Contains(got.Body, `"ok"`) {
		t.Errorf("/health: %+v", got)
	}
}
