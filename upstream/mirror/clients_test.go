package mirror_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/fporigin"
	"github.com/seed-a3c387e8/onceproxy/upstream/mirror"
)

// client runs one real client against url, through the proxy at proxy
// ("" for direct), trusting caFile (PEM) and the SPKI hashes in spki.
type client struct {
	name   string
	host   string // the origin's name in the URL
	strict bool   // the client does not shuffle its extensions: JA3 must match too
	run    func(t *testing.T, url, proxy, caFile, spki string)
}

// need returns the path of a command-line client, skipping the test when
// it is missing (failing under CI, which installs them all).
func need(t *testing.T, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s is not installed (CI needs it)", name)
		}
		t.Skipf("%s is not installed", name)
	}
	return p
}

func runCmd(t *testing.T, name string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	// No proxy settings, no rc files: only what the test passes (and
	// pyenv's own variables, which its python3 shim may need).
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir(), "LANG=C.UTF-8"}
	for _, k := range []string{"PYENV_ROOT", "PYENV_VERSION"} {
		if v, ok := os.LookupEnv(k); ok {
			cmd.Env = append(cmd.Env, k+"="+v)
		}
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %q: %v\n%s", name, args, err, out)
	}
	return string(out)
}

func curl(opts ...string) func(t *testing.T, url, proxy, caFile, spki string) {
	return func(t *testing.T, u, proxy, caFile, _ string) {
		bin := need(t, "curl")
		args := append([]string{"-sS", "--fail", "--cacert", caFile, "-o", "/dev/null", "--max-time", "30"}, opts...)
		if proxy != "" {
			args = append(args, "--proxy", "http://"+proxy)
		}
		runCmd(t, bin, append(args, u)...)
	}
}

const requestsScript = `
import sys, requests
url, ca, proxy = sys.argv[1], sys.argv[2], sys.argv[3]
s = requests.Session()
s.trust_env = False
r = s.get(url, verify=ca, proxies={"https": "http://" + proxy} if proxy else None, timeout=30)
r.raise_for_status()
`

func pythonRequests(t *testing.T, u, proxy, caFile, _ string) {
	bin := os.Getenv("E2E_PYTHON") // CI's pick when the default python3 lacks requests
	if bin == "" {
		bin = need(t, "python3")
	}
	if out, err := exec.Command(bin, "-c", "import requests").CombinedOutput(); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("python3 has no requests: %s", out)
		}
		t.Skipf("python3 has no requests: %s", out)
	}
	runCmd(t, bin, "-c", requestsScript, u, caFile, proxy)
}

func goClient(h2 bool) func(t *testing.T, url, proxy, caFile, spki string) {
	return func(t *testing.T, u, proxy, caFile, _ string) {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			t.Fatal(err)
		}
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(pem)
		tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}, ForceAttemptHTTP2: h2}
		if proxy != "" {
			tr.Proxy = http.ProxyURL(&url.URL{Scheme: "http", Host: proxy})
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

// chromium loads the page headless. Its resolver maps origin.test to the
// loopback origin (with a proxy, the proxy resolves instead).
func chromium(t *testing.T, u, proxy, _, spki string) {
	bin := "/usr/bin/chromium"
	if _, err := os.Stat(bin); err != nil {
		bin = need(t, "chromium")
	}
	args := []string{
		"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync",
		"--disable-extensions", "--disable-default-apps", "--no-pings", "--dns-prefetch-disable",
		"--user-data-dir=" + t.TempDir(),
		"--ignore-certificate-errors-spki-list=" + spki,
		"--host-resolver-rules=MAP origin.test 127.0.0.1, EXCLUDE 127.0.0.1",
	}
	if proxy != "" {
		args = append(args, "--proxy-server=http://"+proxy)
	}
	out := runCmd(t, bin, append(args, "--dump-dom", u)...)
	if !strings.Contains(out, "ok") {
		t.Fatalf("chromium printed no page:\n%s", out)
	}
}

var clients = []client{
	{"curl http1.1", "localhost", true, curl("--http1.1")},
	{"curl http2", "localhost", true, curl("--http2")},
	// OpenSSL without TLS 1.3 sends an empty session id.
	{"curl tls1.2", "localhost", true, curl("--http1.1", "--tls-max", "1.2")},
	{"python requests", "localhost", true, pythonRequests},
	{"go http1.1", "localhost", true, goClient(false)},
	{"go http2", "localhost", true, goClient(true)},
	{"chromium", "origin.test", false, chromium},
}

// withoutHop drops the hop-by-hop names from a header order.
func withoutHop(order []string) []string {
	var out []string
	for _, n := range order {
		if !hopByHop[http.CanonicalHeaderKey(n)] {
			out = append(out, n)
		}
	}
	return out
}

// TestRealClientsThroughMirror runs each real client directly against the
// recording origin, then through the MITM harness, and holds the origin's
// two records to be the same: JA4 (and JA3 for clients that do not
// shuffle their extensions), TLS version, HTTP version and ALPN, the
// HTTP/2 preface and pseudo-header order and priority, and the header
// order with its case, hop-by-hop fields aside. Clients with different
// fingerprints must get different identities.
func TestRealClientsThroughMirror(t *testing.T) {
	origin, err := fporigin.Start(fporigin.Options{Hosts: []string{"origin.test"}})
	if err != nil {
		t.Fatal(err)
	}
	defer origin.Close()
	h := startHarness(t, origin)
	ids := map[fingerprint.ID]string{}
	for i, c := range clients {
		t.Run(c.name, func(t *testing.T) {
			base := fmt.Sprintf("https://%s:%s", c.host, origin.Port())
			direct := fmt.Sprintf("/direct-%d", i)
			c.run(t, base+direct, "", origin.CAFile(), origin.SPKIHash())
			want, err := recordFor(t, origin, direct)
			if err != nil {
				t.Fatal(err)
			}
			mirrored := fmt.Sprintf("/mirrored-%d", i)
			c.run(t, base+mirrored, h.ln.Addr().String(), h.auth.CertPath(), h.spki())
			got, err := recordFor(t, origin, mirrored)
			if err != nil {
				t.Fatal(err)
			}
			if !h.Served(mirrored) {
				t.Fatalf("%s went around the harness", mirrored)
			}
			compare(t, c, want, got)

			id := fingerprint.New(want.Hello, want.H2).ID()
			if other, ok := ids[id]; ok {
				t.Errorf("%s has the fingerprint identity of %s", c.name, other)
			}
			ids[id] = c.name
			if gotID := fingerprint.New(got.Hello, got.H2).ID(); gotID != id {
				t.Errorf("identity through the mirror %s, direct %s", gotID, id)
			}
			t.Logf("JA4 %s  %s  Akamai %q", want.JA4, want.Proto, want.Akamai)
			t.Logf("header order %q", want.Shape.HeaderOrder)
		})
	}
	for _, r := range h.Reports() {
		if r.Mode != mirror.Mirrored {
			t.Errorf("a connection was opened %v: %+v", r.Mode, r)
		}
	}
}

func compare(t *testing.T, c client, want, got fporigin.Record) {
	t.Helper()
	if want.Hello == nil || got.Hello == nil {
		t.Fatalf("no hello recorded: direct %v, mirrored %v", want.Hello != nil, got.Hello != nil)
	}
	check := func(what string, w, g any) {
		t.Helper()
		if fmt.Sprint(w) != fmt.Sprint(g) {
			t.Errorf("%s: direct %v, through the mirror %v", what, w, g)
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
	check("SNI", want.Hello.ServerName, got.Hello.ServerName)
	check("session id length", len(want.Hello.SessionID), len(got.Hello.SessionID))
	if c.strict { // Chrome's GREASE ECH may change size between hellos
		check("hello length", len(want.Hello.Raw), len(got.Hello.Raw))
	}
	if want.Shape == nil || got.Shape == nil {
		t.Fatalf("no shape recorded: direct %v, mirrored %v", want.Shape, got.Shape)
	}
	check("header order", withoutHop(want.Shape.HeaderOrder), withoutHop(got.Shape.HeaderOrder))
	check("pseudo-header order", want.Shape.PseudoOrder, got.Shape.PseudoOrder)
	check("HEADERS priority", fmt.Sprint(want.Shape.Priority != nil && true, ptrVal(want.Shape.Priority)),
		fmt.Sprint(got.Shape.Priority != nil && true, ptrVal(got.Shape.Priority)))
	if !slices.Equal(want.Hello.ALPN, got.Hello.ALPN) {
		t.Errorf("offered ALPN: direct %q, mirrored %q", want.Hello.ALPN, got.Hello.ALPN)
	}
}

func ptrVal(p *fingerprint.Priority) fingerprint.Priority {
	if p == nil {
		return fingerprint.Priority{}
	}
	return *p
}
