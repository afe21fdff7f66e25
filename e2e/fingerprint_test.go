package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/fporigin"
)

// A way is how a client reaches the origin: directly, or through one of
// onceproxy's doors.
type way struct {
	kind   string // "direct", "http" (the proxy port) or "socks5"
	addr   string // the door's address
	caFile string // what the client must trust: the origin's CA, or onceproxy's
	spki   string // the same for Chromium: the SPKI hashes it accepts
}

// fpClient is a real client whose fingerprint the origin records.
type fpClient struct {
	name string
	// strict: the client does not shuffle its TLS extensions, so JA3 (which
	// keeps their order) must match too.
	strict bool
	run    func(t *testing.T, u string, w way)
}

func curlFP(proto string) func(t *testing.T, u string, w way) {
	return func(t *testing.T, u string, w way) {
		bin := needClient(t, "curl", "apt-get install curl")
		args := []string{"-q", "-sS", "--fail", "--max-time", "30", proto, "--cacert", w.caFile, "-o", "/dev/null"}
		switch w.kind {
		case "http":
			args = append(args, "--proxy", "http://"+w.addr)
		case "socks5":
			args = append(args, "--socks5-hostname", w.addr)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		if _, err := runCmd(t, ctx, nil, cleanEnv(), bin, append(args, u)...); err != nil {
			t.Fatal(err)
		}
	}
}

const requestsFP = `
import sys, requests
url, ca, proxy = sys.argv[1], sys.argv[2], sys.argv[3]
s = requests.Session()
s.trust_env = False
r = s.get(url, verify=ca, proxies={"https": proxy} if proxy else None, timeout=30)
r.raise_for_status()
`

// pythonFP runs Python requests: Debian's, whose PySocks speaks SOCKS5.
func pythonFP(t *testing.T, u string, w way) {
	py := needDebianPython(t, "requests, socks")
	proxy := ""
	switch w.kind {
	case "http":
		proxy = "http://" + w.addr
	case "socks5":
		proxy = "socks5h://" + w.addr
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := runCmd(t, ctx, nil, cleanEnv(), py, "-c", requestsFP, u, w.caFile, proxy); err != nil {
		t.Fatal(err)
	}
}

// goFP is Go's net/http client, HTTP/2 or not.
func goFP(h2 bool) func(t *testing.T, u string, w way) {
	return func(t *testing.T, u string, w way) {
		pem, err := os.ReadFile(w.caFile)
		if err != nil {
			t.Fatal(err)
		}
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(pem)
		tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}, ForceAttemptHTTP2: h2}
		switch w.kind {
		case "http":
			tr.Proxy = http.ProxyURL(&url.URL{Scheme: "http", Host: w.addr})
		case "socks5":
			tr.Proxy = http.ProxyURL(&url.URL{Scheme: "socks5", Host: w.addr})
		}
		defer tr.CloseIdleConnections()
		resp, err := (&http.Client{Transport: tr, Timeout: 30 * time.Second}).Get(u)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("status %s", resp.Status)
		}
	}
}

// chromiumFP loads the page with Debian's headless Chromium, fenced like
// every e2e Chromium.
func chromiumFP(t *testing.T, u string, w way) {
	bin := needChromium(t)
	args := append(append([]string(nil), quietFlags...),
		"--user-data-dir="+t.TempDir(),
		"--ignore-certificate-errors-spki-list="+w.spki,
	)
	switch w.kind {
	case "http":
		args = append(args, "--proxy-server=http://"+w.addr, "--proxy-bypass-list="+fenceBypass)
	case "socks5":
		args = append(args, "--proxy-server=socks5://"+w.addr, "--proxy-bypass-list="+fenceBypass)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out, err := runCmd(t, ctx, nil, cleanEnv(), bin, append(args, "--dump-dom", u)...)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), "ok") {
		t.Fatalf("chromium printed no page:\n%s", tail(string(out), 2000))
	}
}

var fpClients = []fpClient{
	{"curl --http1.1", true, curlFP("--http1.1")},
	{"curl --http2", true, curlFP("--http2")},
	{"python requests", true, pythonFP},
	{"go http1.1", true, goFP(false)},
	{"go http2", true, goFP(true)},
	{"chromium", false, chromiumFP},
}

// hopByHop are the fields that end at a proxy (RFC 9110 §7.6.1).
var hopByHop = map[string]bool{
	"Connection": true, "Proxy-Connection": true, "Keep-Alive": true, "Te": true, "Trailer": true,
	"Transfer-Encoding": true, "Upgrade": true, "Proxy-Authorization": true,
}

func withoutHop(order []string) []string {
	var out []string
	for _, n := range order {
		if !hopByHop[http.CanonicalHeaderKey(n)] {
			out = append(out, n)
		}
	}
	return out
}

// fpRecord waits for the origin's record of path.
func fpRecord(t *testing.T, o *fporigin.Origin, path string) fporigin.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for n := 1; ; n++ {
		recs, err := o.Wait(ctx, n)
		for _, r := range recs {
			if r.Path == path {
				return r
			}
		}
		if err != nil {
			t.Fatalf("the origin never saw %s", path)
		}
	}
}

// sameFingerprint holds the origin's record of a request through onceproxy
// (got) to its record of the same client's direct request (want).
func sameFingerprint(t *testing.T, c fpClient, want, got fporigin.Record) {
	t.Helper()
	if want.Hello == nil || got.Hello == nil {
		t.Fatalf("no hello recorded: direct %v, through onceproxy %v", want.Hello != nil, got.Hello != nil)
	}
	check := func(what string, w, g any) {
		t.Helper()
		if fmt.Sprint(w) != fmt.Sprint(g) {
			t.Errorf("%s: direct %v, through onceproxy %v", what, w, g)
		}
	}
	check("JA4", want.JA4, got.JA4)
	if c.strict {
		check("JA3", want.JA3, got.JA3)
	}
	check("TLS version", want.TLSVersion, got.TLSVersion)
	check("ALPN", want.ALPN, got.ALPN)
	check("HTTP version", want.Proto, got.Proto)
	check("Akamai", want.Akamai, got.Akamai)
	if want.Shape == nil || got.Shape == nil {
		t.Fatalf("no shape recorded: direct %v, through onceproxy %v", want.Shape, got.Shape)
	}
	check("header order", withoutHop(want.Shape.HeaderOrder), withoutHop(got.Shape.HeaderOrder))
	check("pseudo-header order", want.Shape.PseudoOrder, got.Shape.PseudoOrder)
	check("HEADERS priority", fmt.Sprint(want.Shape.Priority), fmt.Sprint(got.Shape.Priority))
}

func startFPOrigin(t *testing.T, o fporigin.Options) *fporigin.Origin {
	t.Helper()
	origin, err := fporigin.Start(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { origin.Close() })
	return origin
}

// helloMetric reads onceproxy_upstream_connections_total{hello=...}.
func (p *onceproxy) helloMetric(t *testing.T, hello string) int {
	t.Helper()
	m := regexp.MustCompile(`(?m)^onceproxy_upstream_connections_total\{hello="` + hello + `"\} (\d+)$`).
		FindSubmatch(p.adminGet(t, "/metrics"))
	if m == nil {
		t.Fatalf("no upstream_connections_total{hello=%q} in /metrics", hello)
	}
	n, _ := strconv.Atoi(string(m[1]))
	return n
}

// TestRealClientsMirroredThroughOnceproxy runs curl (--http1.1 and
// --http2), Python requests, Go's net/http (HTTP/1.1 and HTTP/2) and
// headless Chromium against a recording origin directly, then through the
// real onceproxy program (its HTTP port and its SOCKS5 port; leaving
// directly, and through a fake provider session's HTTP CONNECT gateway and
// its SOCKS5 gateway), and holds every record through onceproxy to the
// direct one: JA4 (and JA3 where the client keeps its extension order),
// TLS version, ALPN, HTTP version, the HTTP/2 preface (Akamai string), and
// header and pseudo-header order and HEADERS priority, hop-by-hop fields
// aside. Every origin connection was made with the client's own hello
// (onceproxy_upstream_connections_total), and the status page lists
// Chromium's JA4.
func TestRealClientsMirroredThroughOnceproxy(t *testing.T) {
	origin := startFPOrigin(t, fporigin.Options{})
	base := "https://127.0.0.1:" + origin.Port()
	provider := fakeprovider.Start(t, fakeprovider.Options{})

	direct := map[string]fporigin.Record{}
	for i, c := range fpClients {
		t.Run("direct/"+c.name, func(t *testing.T) {
			path := fmt.Sprintf("/direct-%d", i)
			c.run(t, base+path, way{kind: "direct", caFile: origin.CAFile(), spki: origin.SPKIHash()})
			rec := fpRecord(t, origin, path)
			direct[c.name] = rec
			t.Logf("%s: JA4 %s, %s, Akamai %q, header order %q", c.name, rec.JA4, rec.Proto, rec.Akamai, rec.Shape.HeaderOrder)
		})
	}
	for _, egress := range []struct{ name, url string }{
		{"direct", ""},
		{"CONNECT session", provider.URL("s1", "http")},
		{"SOCKS5 session", provider.URL("s1", "socks5")},
	} {
		t.Run(egress.name, func(t *testing.T) {
			p := startProxy(t, origin.CAFile(), proxyOpts{env: []string{"ONCEPROXY_UPSTREAM_URL=" + egress.url}})
			spki := p.SPKI
			for _, door := range []way{
				{kind: "http", addr: p.ProxyAddr, caFile: p.CAFile, spki: spki},
				{kind: "socks5", addr: p.SOCKSAddr, caFile: p.CAFile, spki: spki},
			} {
				for i, c := range fpClients {
					t.Run(door.kind+"/"+c.name, func(t *testing.T) {
						want, ok := direct[c.name]
						if !ok {
							t.Skip("no direct record of this client")
						}
						path := fmt.Sprintf("/%s-%s-%d", strings.ReplaceAll(egress.name, " ", "-"), door.kind, i)
						c.run(t, base+path, door)
						got := fpRecord(t, origin, path)
						sameFingerprint(t, c, want, got)
						if got.JA4 == want.JA4 {
							t.Logf("through onceproxy: JA4 %s, %s, Akamai %q", got.JA4, got.Proto, got.Akamai)
						}
					})
				}
			}
			if n := p.helloMetric(t, "mirrored"); n == 0 || p.helloMetric(t, "closest") != 0 || p.helloMetric(t, "go") != 0 {
				t.Errorf("origin connections by hello: mirrored %d, closest %d, go %d: want all mirrored",
					n, p.helloMetric(t, "closest"), p.helloMetric(t, "go"))
			}
			if rec, ok := direct["chromium"]; ok && !strings.Contains(string(p.adminGet(t, "/")), rec.JA4) {
				t.Errorf("the status page does not list Chromium's JA4 %s", rec.JA4)
			}
			p.assertLoopbackOnly(t)
		})
	}
}

// A 1x1 transparent PNG.
var pixel = []byte("\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00\x1f\x15\xc4\x89" +
	"\x00\x00\x00\rIDATx\x9cc\xf8\x0f\x00\x00\x01\x01\x00\x05\x18\xd8N\x00\x00\x00\x00IEND\xaeB`\x82")

// TestChromiumStampedeReachesTheOriginOnce: a page makes headless Chromium
// ask for one image under 500 URLs that differ only in a tracking
// parameter (500 requests to Chromium, one request key to onceproxy), all
// at once over its HTTP/2 connection. The origin, slow to answer, sees the
// image once, and that one request carries Chromium's own fingerprint: the
// flight's leader's.
func TestChromiumStampedeReachesTheOriginOnce(t *testing.T) {
	const n = 500
	var page strings.Builder
	page.WriteString("<!doctype html><html><body>\n")
	for i := range n {
		fmt.Fprintf(&page, "<img src=\"/px.png?utm_source=s%d\" width=\"1\" height=\"1\">\n", i)
	}
	page.WriteString(`<p id="loaded">pending</p>
<script>
window.addEventListener('load', () => {
  const ok = [...document.images].filter((i) => i.complete && i.naturalWidth > 0).length;
  document.getElementById('loaded').textContent = 'loaded ' + ok;
});
</script></body></html>`)
	origin := startFPOrigin(t, fporigin.Options{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/stampede.html":
			io.WriteString(w, page.String())
		case "/px.png":
			time.Sleep(300 * time.Millisecond) // the others arrive while it is in flight
			w.Header().Set("Content-Type", "image/png")
			w.Write(pixel)
		default:
			io.WriteString(w, "ok")
		}
	})})
	base := "https://127.0.0.1:" + origin.Port()
	chromiumFP(t, base+"/direct", way{kind: "direct", caFile: origin.CAFile(), spki: origin.SPKIHash()})
	want := fpRecord(t, origin, "/direct")

	p := startProxy(t, origin.CAFile(), proxyOpts{})
	bin := needChromium(t)
	args := append(append([]string(nil), quietFlags...),
		"--user-data-dir="+t.TempDir(),
		"--ignore-certificate-errors-spki-list="+p.SPKI,
		"--proxy-server=http://"+p.ProxyAddr, "--proxy-bypass-list="+fenceBypass,
		"--dump-dom", base+"/stampede.html")
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	out, err := runCmd(t, ctx, nil, cleanEnv(), bin, args...)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), fmt.Sprintf("loaded %d", n)) {
		t.Errorf("Chromium did not load the %d images: %s", n, tail(regexp.MustCompile(`<img[^>]*>\s*`).ReplaceAllString(string(out), ""), 500))
	}
	var pixels []fporigin.Record
	for _, r := range origin.Records() {
		if strings.HasPrefix(r.Path, "/px.png?") {
			pixels = append(pixels, r)
		}
	}
	if len(pixels) != 1 {
		t.Fatalf("the origin saw the image %d times, want once", len(pixels))
	}
	got := pixels[0]
	if got.JA4 != want.JA4 || got.Akamai != want.Akamai || got.Proto != want.Proto {
		t.Errorf("the one request for the image: JA4 %s %s Akamai %q; Chromium directly: JA4 %s %s Akamai %q",
			got.JA4, got.Proto, got.Akamai, want.JA4, want.Proto, want.Akamai)
	}
	st := p.stats(t)
	if st.XCache["HIT"]+st.XCache["COALESCED"] < n-1 {
		t.Errorf("stats %+v: want the %d image requests answered from one flight", st, n)
	}
	t.Logf("stampede: origin saw the image once (JA4 %s, %s), X-Cache %v", got.JA4, got.Proto, st.XCache)
	p.assertLoopbackOnly(t)
}
