package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// needDebianPython finds a python3 with Debian's scrapy, requests and
// PySocks (apt-get install python3-scrapy python3-requests python3-socks;
// PyPI is not used). $E2E_DEBIAN_PYTHON overrides /usr/bin/python3.
func needDebianPython(t *testing.T, modules string) string {
	t.Helper()
	py := os.Getenv("E2E_DEBIAN_PYTHON")
	if py == "" {
		py = "/usr/bin/python3"
	}
	if _, err := os.Stat(py); err != nil {
		missing(t, py+" not found (apt-get install python3)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := runCmd(t, ctx, nil, cleanEnv(), py, "-c", "import "+modules); err != nil {
		missing(t, fmt.Sprintf("%s cannot import %s (apt-get install --no-install-recommends python3-scrapy python3-requests python3-socks)", py, modules))
	}
	return py
}

// TestScrapy runs the README's Scrapy recipes: the proxy, credentials and
// a session name included, from https_proxy (Scrapy's HttpProxyMiddleware),
// or from each request's meta["proxy"]. 32 concurrent requests ask for 50
// URLs ten times each with varying tracking parameters; the origin sees
// the 50 URLs once each.
func TestScrapy(t *testing.T) {
	py := needDebianPython(t, "scrapy")
	t.Run("HTTPSProxyEnv", func(t *testing.T) { runScrapy(t, py, false) })
	t.Run("MetaProxy", func(t *testing.T) { runScrapy(t, py, true) })
}

func runScrapy(t *testing.T, py string, meta bool) {
	const distinct, repeat = 50, 10
	o := startOrigin(t, 100*time.Millisecond)
	p := startProxy(t, o.CAFile, proxyOpts{auth: true})
	user := proxyUser + "-session-scrapy"
	proxy := p.URL(user, proxyPassword)
	job := map[string]any{"base": o.URL, "distinct": distinct, "repeat": repeat, "concurrency": 32}
	var env []string
	if meta {
		job["meta_proxy"] = proxy
	} else {
		env = []string{"https_proxy=" + proxy, "http_proxy=" + proxy}
	}
	in, _ := json.Marshal(job)
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	out, err := runCmd(t, ctx, in, cleanEnv(env...), py, filepath.Join(repoRoot, "e2e", "python", "scrapy_fleet.py"))
	if err != nil {
		t.Fatalf("scrapy_fleet.py: %v", err)
	}
	var s struct {
		Requests, OK  int
		XCache        map[string]int `json:"x_cache"`
		Status        map[string]int
		Errors        []string
		ScrapyVersion string `json:"scrapy_version"`
	}
	if err := json.Unmarshal(out, &s); err != nil {
		t.Fatalf("scrapy_fleet.py output %q: %v", out, err)
	}
	t.Logf("Scrapy %s: %+v", s.ScrapyVersion, s)
	if s.Requests != distinct*repeat || s.OK != s.Requests || len(s.Errors) != 0 {
		t.Fatalf("%d responses, %d right, errors %v", s.Requests, s.OK, s.Errors)
	}
	byPath := o.countByPath()
	for i := range distinct {
		if n := byPath[fmt.Sprintf("/data/%d", i)]; n != 1 {
			t.Errorf("origin got /data/%d %d times, want 1", i, n)
		}
	}
	if len(o.requests()) != distinct {
		t.Errorf("origin got %d requests, want %d", len(o.requests()), distinct)
	}
	if s.XCache["MISS"] != distinct || s.XCache["HIT"]+s.XCache["COALESCED"] != distinct*(repeat-1) {
		t.Errorf("Scrapy saw X-Cache %v", s.XCache)
	}
	for _, rec := range p.accessLog() {
		if rec["user"] != user {
			t.Errorf("a request without the proxy user %s: %v", user, rec)
			break
		}
	}
	p.assertLoopbackOnly(t)
}

// TestPythonRequestsSOCKS5: requests over SOCKS5 (PySocks, Debian's
// python3-socks): proxies={"https": "socks5h://user:pass@host:port"} with
// verify=ca.pem; socks5h lets onceproxy resolve the name.
func TestPythonRequestsSOCKS5(t *testing.T) {
	py := needDebianPython(t, "requests, socks")
	o := startOrigin(t, 0)
	p := startProxy(t, o.CAFile, proxyOpts{auth: true})
	script := `
import json, sys, requests
job = json.load(sys.stdin)
proxies = {"http": job["proxy"], "https": job["proxy"]}
out = []
for url in job["urls"]:
    r = requests.get(url, proxies=proxies, verify=job["ca"], timeout=20)
    out.append([r.status_code, r.headers.get("X-Cache", ""), r.text])
json.dump(out, sys.stdout)
`
	in, _ := json.Marshal(map[string]any{
		"proxy": "socks5h://" + proxyUser + "-session-py:" + proxyPassword + "@" + p.SOCKSAddr,
		"ca":    p.CAFile,
		"urls":  []string{o.URL + "/hello", o.URL + "/hello?utm_source=x", o.Plain + "/hello"},
	})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out, err := runCmd(t, ctx, in, cleanEnv(), py, "-c", script)
	if err != nil {
		t.Fatalf("requests over SOCKS5: %v", err)
	}
	var got [][3]any
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("output %q: %v", out, err)
	}
	want := []string{"MISS", "HIT", "MISS"}
	for i, g := range got {
		if g[0] != float64(200) || g[1] != want[i] {
			t.Errorf("request %d: %v, want 200 %s", i, g, want[i])
		}
	}
	if len(got) != 3 || len(o.requests()) != 2 {
		t.Errorf("%d answers; origin got %d requests, want 2 (https once, http once)", len(got), len(o.requests()))
	}
	p.assertLoopbackOnly(t)
}
