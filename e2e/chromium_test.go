package e2e

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// quietFlags keep Chromium's own background traffic (updates, safe
// browsing, sync, field trials, DNS prefetch) from leaving the machine;
// e2e/browser/flags.mjs has the same list (TestBrowserFlagsInSync). The last
// one fences the sandbox: with fenceBypass, a host that is not loopback goes
// direct and fails in Chromium's own resolver, reaching neither onceproxy
// nor a DNS server. (Without the fence Chromium 156 still sends
// update.googleapis.com and accounts.google.com requests to the proxy.)
var quietFlags = []string{
	"--headless",
	"--no-sandbox",
	"--disable-gpu",
	"--disable-quic",
	"--no-first-run",
	"--disable-background-networking",
	"--disable-component-update",
	"--disable-sync",
	"--disable-default-apps",
	"--disable-extensions",
	"--disable-domain-reliability",
	"--disable-client-side-phishing-detection",
	"--no-pings",
	"--dns-prefetch-disable",
	"--disable-features=OptimizationHints,MediaRouter,Translate,AutofillServerCommunication,CertificateTransparencyComponentUpdater,NetworkTimeServiceQuerying",
	"--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
}

// fenceBypass is the proxy bypass list of the tests: Chromium reads the
// rules from the last back, so loopback ("<-loopback>" lifts the implicit
// loopback bypass) goes through the proxy and everything else ("*") direct,
// into the resolver fence. ("<-loopback>,*" would bypass loopback too.)
const fenceBypass = "*,<-loopback>"

// TestBrowserFlagsInSync: the Node scripts launch Chromium with the same
// flags as the plain chromium runs.
func TestBrowserFlagsInSync(t *testing.T) {
	src, err := os.ReadFile(filepath.Join(repoRoot, "e2e", "browser", "flags.mjs"))
	if err != nil {
		t.Fatal(err)
	}
	s := string(src)
	_, list, _ := strings.Cut(s, "export const quietFlags = [")
	list, _, _ = strings.Cut(list, "];")
	var js []string
	for _, line := range strings.Split(list, "\n") {
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, "'") {
			js = append(js, strings.TrimSuffix(strings.TrimSuffix(line, ","), "'")[1:])
		}
	}
	if strings.Join(js, "\n") != strings.Join(quietFlags, "\n") {
		t.Errorf("flags.mjs quietFlags:\n%s\nchromium_test.go quietFlags:\n%s", strings.Join(js, "\n"), strings.Join(quietFlags, "\n"))
	}
	if !strings.Contains(s, "export const fenceBypass = '"+fenceBypass+"';") {
		t.Errorf("flags.mjs fenceBypass differs from %q", fenceBypass)
	}
}

// needChromium finds Debian's chromium ($E2E_CHROMIUM overrides).
func needChromium(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("E2E_CHROMIUM"); p != "" {
		return p
	}
	return needClient(t, "chromium", "apt-get install chromium")
}

// needNodeModule checks node and the e2e/browser packages (npm ci).
func needNodeModule(t *testing.T, module string) string {
	t.Helper()
	node := needClient(t, "node", "apt-get install nodejs")
	if _, err := os.Stat(filepath.Join(repoRoot, "e2e", "browser", "node_modules", module, "package.json")); err != nil {
		missing(t, module+" not installed (npm ci --prefix e2e/browser)")
	}
	return node
}

// pwResponse is one response a Playwright page saw.
type pwResponse struct {
	URL      string            `json:"url"`
	Status   int               `json:"status"`
	Type     string            `json:"type"`
	XCache   string            `json:"xcache"`
	Upstream string            `json:"upstream"`
	Sent     map[string]string `json:"sent"` // request headers that matter to a cache
}

// pwPage is what one tab saw.
type pwPage struct {
	Label        string       `json:"label"`
	Status       int          `json:"status"`
	XCache       string       `json:"xcache"`
	Protocol     string       `json:"protocol"`
	Issuer       string       `json:"issuer"`
	Title        string       `json:"title"`
	Images       int          `json:"images"`
	ImagesLoaded int          `json:"imagesLoaded"`
	AppRuns      int          `json:"appRuns"`
	Fetched      string       `json:"fetched"`
	H1Color      string       `json:"h1Color"`
	Error        string       `json:"error"`
	Responses    []pwResponse `json:"responses"`
	Failed       []struct {
		URL   string `json:"url"`
		Error string `json:"error"`
	} `json:"failed"`
}

type pwPagesResult struct {
	Version string   `json:"version"`
	Pages   []pwPage `json:"pages"`
	Reloads []pwPage `json:"reloads"`
}

// playwright runs e2e/browser/playwright.mjs with job on stdin and decodes
// its JSON answer into out.
func playwright(t *testing.T, job map[string]any, out any) {
	t.Helper()
	node := needNodeModule(t, "playwright-core")
	job["chromium"] = needChromium(t)
	in, err := json.Marshal(job)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	stdout, err := runCmd(t, ctx, in, cleanEnv(), node, filepath.Join(repoRoot, "e2e", "browser", "playwright.mjs"))
	if err != nil {
		t.Fatalf("playwright %s: %v", job["scenario"], err)
	}
	if err := json.Unmarshal(stdout, out); err != nil {
		t.Fatalf("playwright %s: bad output %q: %v", job["scenario"], stdout, err)
	}
}

// countXCache counts the X-Cache values of every response the pages saw.
func countXCache(pages []pwPage) map[string]int {
	n := map[string]int{}
	for _, p := range pages {
		for _, r := range p.Responses {
			n[r.XCache]++
		}
	}
	return n
}

// checkPageLoaded: the page, its stylesheet, scripts, images and fetch all
// arrived through the MITM with the CA trusted by SPKI.
func checkPageLoaded(t *testing.T, p pwPage) {
	t.Helper()
	if p.Error != "" || p.Status != 200 {
		t.Errorf("%s: status %d, error %q", p.Label, p.Status, p.Error)
		return
	}
	if p.Title != "Loaded through onceproxy" {
		t.Errorf("%s: title %q", p.Label, p.Title)
	}
	if want := dupCount + 10; p.Images != want || p.ImagesLoaded != want {
		t.Errorf("%s: %d of %d images loaded, want %d", p.Label, p.ImagesLoaded, p.Images, want)
	}
	if p.AppRuns != dupCount {
		t.Errorf("%s: app.js ran %d times, want %d (once per <script>)", p.Label, p.AppRuns, dupCount)
	}
	if !strings.HasPrefix(p.Fetched, "fetched ") {
		t.Errorf("%s: fetch(): %q", p.Label, p.Fetched)
	}
	if p.H1Color != "rgb(23, 128, 61)" {
		t.Errorf("%s: stylesheet not applied (h1 color %q)", p.Label, p.H1Color)
	}
	if !strings.Contains(p.Issuer, "onceproxy") {
		t.Errorf("%s: certificate issuer %q, want onceproxy's CA", p.Label, p.Issuer)
	}
	for _, f := range p.Failed {
		t.Errorf("%s: request failed: %s %s", p.Label, f.URL, f.Error)
	}
	for _, r := range p.Responses {
		if r.XCache == "" {
			t.Errorf("%s: %s answered without X-Cache: it did not go through onceproxy", p.Label, r.URL)
		}
	}
}

// TestChromiumPlaywrightTabs: two browser contexts (separate caches, like
// two scraper profiles) with two tabs each load the same page at once
// through onceproxy, then the first tab reloads twice. The page pulls the
// same stylesheet, script and image twenty times each, one image under five
// tracking-parameter variants, five distinct images, a stylesheet that must
// be revalidated on every use (ETag + no-cache) and a fetch() of the shared
// image. Every tab loads completely with onceproxy's CA trusted by its SPKI
// hash; duplicates are HIT or COALESCED; the origin sees each request key
// once.
//
// What Chromium does, and so what the origin sees:
//   - within one document it asks once per URL however often the page names
//     it; the tracking variants are five URLs to it (one key to onceproxy);
//   - a tab of a context with no cached copy asks again (responses without
//     freshness are not reused), and so does a reload: those are HIT;
//   - a fetch() sends Accept */* where an <img> sends image/...: Accept is a
//     key header, so that URL reaches the origin once per Accept value;
//   - a cached response with a validator is revalidated (If-None-Match);
//     conditional requests are keyed apart and a 304 is not cached, so each
//     revalidation reaches the origin (once, however many ask at once).
func TestChromiumPlaywrightTabs(t *testing.T) {
	const contexts, tabs, reloads = 2, 2, 2
	o := startOrigin(t, 150*time.Millisecond)
	p := startProxy(t, o.CAFile, proxyOpts{})
	var res pwPagesResult
	playwright(t, map[string]any{
		"scenario": "pages",
		"spki":     p.SPKI,
		"proxy":    map[string]any{"server": p.URL("", "")},
		"url":      o.URL + "/page.html",
		"contexts": contexts,
		"pages":    tabs,
		"reloads":  reloads,
	}, &res)
	t.Logf("Chromium %s", res.Version)
	if len(res.Pages) != contexts*tabs || len(res.Reloads) != reloads {
		t.Fatalf("got %d page loads and %d reloads", len(res.Pages), len(res.Reloads))
	}
	all := append(append([]pwPage(nil), res.Pages...), res.Reloads...)
	for _, pg := range all {
		checkPageLoaded(t, pg)
		t.Logf("%s: %s, certificate from %q, document X-Cache %s, %d responses %v",
			pg.Label, pg.Protocol, pg.Issuer, pg.XCache, len(pg.Responses), countXCache([]pwPage{pg}))
	}
	// What a tab sees: one response per URL (Chromium's memory cache
	// answers the 19 other uses), the five tracking variants apart.
	for _, pg := range res.Pages {
		n := map[string]int{}
		for _, r := range pg.Responses {
			n[strings.TrimPrefix(r.URL, o.URL)]++
		}
		if n["/static/logo.svg"] != 2 || n["/static/app.js"] != 1 || n["/static/site.css"] != 1 {
			t.Errorf("%s: responses per URL %v; want logo.svg twice (img + fetch), app.js and site.css once", pg.Label, n)
		}
	}
	for _, pg := range res.Reloads {
		for _, r := range pg.Responses {
			switch {
			case r.Type == "document":
				// A reload asks for the document with max-age=0;
				// onceproxy answers it from its cache all the same.
				t.Logf("%s: document sent %v, got %s", pg.Label, r.Sent, r.XCache)
				if r.XCache != "HIT" {
					t.Errorf("%s: reloaded document X-Cache %s, want HIT", pg.Label, r.XCache)
				}
			case strings.HasSuffix(r.URL, "/static/etag.css"):
				if r.Sent["if-none-match"] != `"v1"` || r.Status != 304 || r.XCache != "MISS" {
					t.Errorf("%s: etag.css sent %v, got %d %s; want a conditional request, a 304, MISS", pg.Label, r.Sent, r.Status, r.XCache)
				}
			case r.XCache != "HIT":
				t.Errorf("%s: %s X-Cache %s, want HIT", pg.Label, r.URL, r.XCache)
			}
		}
	}

	t.Logf("origin received:\n%s", o.describe())
	// The origin sees every request key once: path (tracking parameters
	// do not count), Accept, and the conditional header.
	type key struct{ path, accept, inm string }
	keys := map[key]int{}
	unconditionalETag, conditionalETag := 0, 0
	for _, r := range o.requests() {
		k := key{r.Path, r.Header.Get("Accept"), r.Header.Get("If-None-Match")}
		keys[k]++
		if r.Path == "/static/etag.css" {
			if k.inm == "" {
				unconditionalETag++
			} else {
				conditionalETag++
			}
			continue
		}
		if keys[k] > 1 {
			t.Errorf("origin got %s (Accept %q) %d times, want once", r.Path, k.accept, keys[k])
		}
	}
	byPath := o.countByPath()
	for path, want := range map[string]int{
		"/page.html": 1, "/static/site.css": 1, "/static/app.js": 1,
		"/static/logo.svg":    2, // <img> and fetch() send different Accept headers
		"/static/tracked.svg": 1, // five URLs, one key
		"/static/p1.svg":      1, "/static/p5.svg": 1,
	} {
		if byPath[path] != want {
			t.Errorf("origin got %s %d times, want %d", path, byPath[path], want)
		}
	}
	// etag.css: one full response; then revalidations that no cache may
	// answer: each reload, and a later tab of a context whose first tab
	// had cached it by then (at the same moment in both contexts, those
	// two are COALESCED).
	if maxCond := reloads + contexts*(tabs-1); unconditionalETag != 1 || conditionalETag < reloads || conditionalETag > maxCond {
		t.Errorf("origin got etag.css %d times unconditionally (want 1) and %d times conditionally (want %d..%d)",
			unconditionalETag, conditionalETag, reloads, maxCond)
	}

	st := p.stats(t)
	xc := countXCache(all)
	t.Logf("X-Cache of the responses the tabs saw: %v; /cache/stats: %+v", xc, st)
	originN := uint64(len(o.requests()))
	if st.XCache["MISS"] != originN || st.UpstreamRequests != originN {
		t.Errorf("stats: MISS %d, upstream requests %d; the origin got %d", st.XCache["MISS"], st.UpstreamRequests, originN)
	}
	if st.XCache["BYPASS"] != 0 {
		t.Errorf("stats: BYPASS %d, want 0", st.XCache["BYPASS"])
	}
	saved := st.XCache["HIT"] + st.XCache["COALESCED"]
	if saved+st.XCache["MISS"] != st.Requests || saved < 50 {
		t.Errorf("stats: HIT+COALESCED = %d of %d requests; want every duplicate (at least 50)", saved, st.Requests)
	}
	if xc["HIT"]+xc["COALESCED"] == 0 || xc["MISS"] > int(originN) {
		t.Errorf("the tabs saw X-Cache %v", xc)
	}
	p.assertLoopbackOnly(t)

	t.Run("StatusPage", func(t *testing.T) { checkStatusPage(t, p, st) })
}

// checkStatusPage opens the admin GET / page in Chromium (directly, not
// through the proxy), checks its numbers against /cache/stats, and saves a
// full-page screenshot to the artifacts directory.
func checkStatusPage(t *testing.T, p *onceproxy, st stats) {
	shot := filepath.Join(artifactsDir(t), "admin.png")
	_ = os.Remove(shot)
	var page struct {
		Status                                                    int
		Title                                                     string
		Savings, Requests, Hit, Coalesced, Miss, Bypass, Upstream string
		SPKI                                                      string `json:"spki"`
		CALink                                                    int    `json:"caLink"`
		Recipes                                                   string
		Screenshot                                                string
	}
	playwright(t, map[string]any{"scenario": "status", "spki": p.SPKI,
		"url": "http://" + p.AdminAddr + "/", "screenshot": shot}, &page)
	if again := p.stats(t); again.Requests != st.Requests {
		t.Fatalf("requests went on while the page was read: %d, then %d", st.Requests, again.Requests)
	}
	u := func(n uint64) string { return strconv.FormatUint(n, 10) }
	want := map[string][2]string{
		"#savings":   {page.Savings, strconv.FormatFloat(st.SavingsPct, 'f', -1, 64) + "%"},
		"#requests":  {page.Requests, u(st.Requests)},
		"#hit":       {page.Hit, u(st.XCache["HIT"])},
		"#coalesced": {page.Coalesced, u(st.XCache["COALESCED"])},
		"#miss":      {page.Miss, u(st.XCache["MISS"])},
		"#bypass":    {page.Bypass, u(st.XCache["BYPASS"])},
		"#upstream":  {page.Upstream, u(st.UpstreamRequests)},
		"#spki":      {page.SPKI, p.SPKI},
	}
	for id, v := range want {
		if v[0] != v[1] {
			t.Errorf("status page %s = %q, /cache/stats says %q", id, v[0], v[1])
		}
	}
	if page.Status != 200 || page.Title != "onceproxy" || page.CALink == 0 {
		t.Errorf("status page: %d %q, %d links to /ca.pem", page.Status, page.Title, page.CALink)
	}
	// Its recipes name this proxy and this CA.
	if want := "--proxy-server=http://" + p.ProxyAddr + " --ignore-certificate-errors-spki-list=" + p.SPKI; !strings.Contains(page.Recipes, want) {
		t.Errorf("status page recipes lack %q:\n%s", want, page.Recipes)
	}
	fi, err := os.Stat(shot)
	if err != nil || fi.Size() < 10_000 {
		t.Fatalf("screenshot %s: %v (size %v)", shot, err, fi)
	}
	t.Logf("status page: savings %s, requests %s, HIT %s, COALESCED %s, MISS %s; screenshot: %s",
		page.Savings, page.Requests, page.Hit, page.Coalesced, page.Miss, shot)
}

// TestChromiumPlaywrightProxyAuth: with proxy users configured, Chromium
// sends no credentials until challenged; onceproxy answers the CONNECT with
// 407 and Proxy-Authenticate: Basic, and Playwright's proxy option answers
// the challenge. Without credentials, or with a wrong password, the page
// does not load.
func TestChromiumPlaywrightProxyAuth(t *testing.T) {
	o := startOrigin(t, 50*time.Millisecond)
	p := startProxy(t, o.CAFile, proxyOpts{auth: true})
	job := func(user, password string) map[string]any {
		proxy := map[string]any{"server": p.URL("", "")}
		if user != "" {
			proxy["username"], proxy["password"] = user, password
		}
		return map[string]any{"scenario": "pages", "spki": p.SPKI, "proxy": proxy,
			"url": o.URL + "/page.html", "contexts": 1, "pages": 2}
	}

	var ok pwPagesResult
	playwright(t, job(proxyUser+"-session-e2e", proxyPassword), &ok)
	for _, pg := range ok.Pages {
		checkPageLoaded(t, pg)
		t.Logf("%s with credentials: %d, %d responses %v", pg.Label, pg.Status, len(pg.Responses), countXCache([]pwPage{pg}))
	}
	failures := metric(t, p, "onceproxy_auth_failures_total")
	if failures < 1 {
		t.Errorf("onceproxy_auth_failures_total = %v: Chromium was never challenged", failures)
	}
	users := map[string]int{}
	for _, rec := range p.accessLog() {
		u, _ := rec["user"].(string)
		users[u]++
	}
	if users[proxyUser+"-session-e2e"] == 0 || users[""] != 0 {
		t.Errorf("access log users %v: every request should carry the proxy user", users)
	}
	t.Logf("407 challenges answered: %v; requests per proxy user: %v", failures, users)

	for _, c := range []struct{ name, user, password string }{
		{"no credentials", "", ""},
		{"wrong password", proxyUser, "wrong"},
	} {
		before := len(o.requests())
		var bad pwPagesResult
		playwright(t, job(c.user, c.password), &bad)
		for _, pg := range bad.Pages {
			t.Logf("%s: %s: status %d, error %q", c.name, pg.Label, pg.Status, pg.Error)
			if pg.Error == "" && pg.Status == 200 {
				t.Errorf("%s: %s loaded the page", c.name, pg.Label)
			}
		}
		if n := len(o.requests()); n != before {
			t.Errorf("%s: the origin got %d requests", c.name, n-before)
		}
	}
	p.assertLoopbackOnly(t)
}

// metric reads one counter (summed over its labels) from GET /metrics.
func metric(t *testing.T, p *onceproxy, name string) float64 {
	t.Helper()
	var sum float64
	for _, line := range strings.Split(string(p.adminGet(t, "/metrics")), "\n") {
		if !strings.HasPrefix(line, name) {
			continue
		}
		rest := strings.TrimPrefix(line, name)
		if rest == "" || (rest[0] != ' ' && rest[0] != '{') {
			continue
		}
		fields := strings.Fields(line)
		v, err := strconv.ParseFloat(fields[len(fields)-1], 64)
		if err == nil {
			sum += v
		}
	}
	return sum
}

// dumpDOM runs chromium --headless --dump-dom url through the proxy with
// the quiet flags, a fresh profile and extra flags, with env added.
func dumpDOM(t *testing.T, chromium, proxy, url string, env []string, extra ...string) string {
	t.Helper()
	args := append(append([]string(nil), quietFlags...),
		"--user-data-dir="+t.TempDir(),
		"--proxy-server="+proxy,
		"--proxy-bypass-list="+fenceBypass,
	)
	args = append(append(args, extra...), "--dump-dom", url)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out, err := runCmd(t, ctx, nil, cleanEnv(env...), chromium, args...)
	if err != nil {
		t.Fatalf("chromium --dump-dom: %v", err)
	}
	return string(out)
}

// TestChromiumFlagsDumpDOM is the README's Chromium recipe without any
// automation tool: --proxy-server, the CA trusted by its SPKI hash (as the
// README's openssl pipeline computes it), a fresh --user-data-dir,
// --dump-dom. Without the SPKI flag the same run gets no page: the trust
// comes from the flag, not from anything else.
func TestChromiumFlagsDumpDOM(t *testing.T) {
	chromium := needChromium(t)
	o := startOrigin(t, 0)
	p := startProxy(t, o.CAFile, proxyOpts{})
	sh := needClient(t, "sh", "a POSIX shell")
	needClient(t, "openssl", "apt-get install openssl")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	spki, err := runCmd(t, ctx, nil, cleanEnv("CA="+p.CAFile), sh, "-c",
		`openssl x509 -in "$CA" -noout -pubkey | openssl pkey -pubin -outform der | openssl dgst -sha256 -binary | base64`)
	if err != nil || strings.TrimSpace(string(spki)) != p.SPKI {
		t.Fatalf("the README's openssl pipeline gives %q (%v); the CA's SPKI hash is %s", spki, err, p.SPKI)
	}
	dump := func(trust bool) string {
		if trust {
			return dumpDOM(t, chromium, p.URL("", ""), o.URL+"/page.html", nil, "--ignore-certificate-errors-spki-list="+strings.TrimSpace(string(spki)))
		}
		return dumpDOM(t, chromium, p.URL("", ""), o.URL+"/page.html", nil)
	}

	dom := dump(true)
	if !strings.Contains(dom, `<h1 id="title">Loaded through onceproxy</h1>`) {
		t.Fatalf("chromium --dump-dom printed no page:\n%s", tail(dom, 2000))
	}
	byPath := o.countByPath()
	if byPath["/page.html"] != 1 || byPath["/static/logo.svg"] < 1 {
		t.Errorf("origin got %v", byPath)
	}
	st := p.stats(t)
	if st.XCache["MISS"] < 1 || st.XCache["HIT"]+st.XCache["COALESCED"] < 4 {
		t.Errorf("stats %+v: want the page through onceproxy, the five tracking variants of one image answered once", st)
	}
	t.Logf("with --ignore-certificate-errors-spki-list: %d bytes of DOM; origin %v; stats %+v", len(dom), byPath, st)

	before := len(o.requests())
	if dom := dump(false); strings.Contains(dom, "Loaded through onceproxy") {
		t.Errorf("without the SPKI flag Chromium accepted onceproxy's certificate:\n%s", tail(dom, 1000))
	}
	if n := len(o.requests()); n != before {
		t.Errorf("without the SPKI flag the origin still got %d requests", n-before)
	}
	p.assertLoopbackOnly(t)
}

// TestPuppeteerAuthenticate is the README's Puppeteer recipe:
// puppeteer-core with Debian's chromium, the proxy and SPKI flags in args,
// and page.authenticate answering onceproxy's 407. Two tabs load the same
// page at once.
func TestPuppeteerAuthenticate(t *testing.T) {
	node := needNodeModule(t, "puppeteer-core")
	chromium := needChromium(t)
	o := startOrigin(t, 100*time.Millisecond)
	p := startProxy(t, o.CAFile, proxyOpts{auth: true})
	in, _ := json.Marshal(map[string]any{
		"chromium": chromium, "spki": p.SPKI, "proxy": p.URL("", ""),
		"username": proxyUser, "password": proxyPassword,
		"url": o.URL + "/page.html", "pages": 2,
	})
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	out, err := runCmd(t, ctx, in, cleanEnv(), node, filepath.Join(repoRoot, "e2e", "browser", "puppeteer.mjs"))
	if err != nil {
		t.Fatalf("puppeteer: %v", err)
	}
	var res struct {
		Version string
		Pages   []struct {
			Label, XCache, Issuer, Title, Error string
			Status, Images, ImagesLoaded        int
			Responses                           []pwResponse
		}
	}
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("puppeteer output %q: %v", out, err)
	}
	t.Logf("puppeteer-core drove %s", res.Version)
	for _, pg := range res.Pages {
		xc := map[string]int{}
		for _, r := range pg.Responses {
			xc[r.XCache]++
		}
		t.Logf("%s: %d %q, issuer %q, %d/%d images, X-Cache %v", pg.Label, pg.Status, pg.Error, pg.Issuer, pg.ImagesLoaded, pg.Images, xc)
		if pg.Status != 200 || pg.Title != "Loaded through onceproxy" || pg.ImagesLoaded != dupCount+10 || !strings.Contains(pg.Issuer, "onceproxy") {
			t.Errorf("%s did not load through onceproxy", pg.Label)
		}
		if xc[""] != 0 {
			t.Errorf("%s: %d responses without X-Cache", pg.Label, xc[""])
		}
	}
	st := p.stats(t)
	if st.XCache["HIT"]+st.XCache["COALESCED"] == 0 || metric(t, p, "onceproxy_auth_failures_total") < 1 {
		t.Errorf("stats %+v: want duplicates answered and at least one 407 challenge", st)
	}
	for path, n := range o.countByPath() {
		if n > 2 {
			t.Errorf("origin got %s %d times", path, n)
		}
	}
	p.assertLoopbackOnly(t)
}

// TestChromiumNSSStore is the README's other Chromium recipe: the CA added
// to the NSS database Chromium reads on Linux ($HOME/.pki/nssdb) with
// certutil, and no SPKI flag.
func TestChromiumNSSStore(t *testing.T) {
	chromium := needChromium(t)
	certutil := needClient(t, "certutil", "apt-get install libnss3-tools")
	o := startOrigin(t, 0)
	p := startProxy(t, o.CAFile, proxyOpts{})
	home := t.TempDir()
	db := "sql:" + filepath.Join(home, ".pki", "nssdb")
	if err := os.MkdirAll(filepath.Join(home, ".pki", "nssdb"), 0o700); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, args := range [][]string{
		{"-d", db, "-N", "--empty-password"},
		{"-d", db, "-A", "-t", "C,,", "-n", "onceproxy", "-i", p.CAFile},
	} {
		if _, err := runCmd(t, ctx, nil, cleanEnv("HOME="+home), certutil, args...); err != nil {
			t.Fatalf("certutil %v: %v", args, err)
		}
	}
	dom := dumpDOM(t, chromium, p.URL("", ""), o.URL+"/page.html", []string{"HOME=" + home})
	if !strings.Contains(dom, `<h1 id="title">Loaded through onceproxy</h1>`) {
		t.Fatalf("with the CA in $HOME/.pki/nssdb chromium printed no page:\n%s", tail(dom, 2000))
	}
	if st := p.stats(t); st.XCache["MISS"] < 1 {
		t.Errorf("stats %+v: the page did not go through onceproxy", st)
	}
	p.assertLoopbackOnly(t)
}

// TestChromiumIgnoresProxyCredentialsInFlag: Chromium takes no credentials
// in --proxy-server. Given http://user:pass@host:port it does not use that
// proxy at all: onceproxy never hears from it (no request, no 407), and the
// page does not load. From the command line, a proxy with users needs a
// person or an automation tool to answer the 407.
func TestChromiumIgnoresProxyCredentialsInFlag(t *testing.T) {
	chromium := needChromium(t)
	o := startOrigin(t, 0)
	p := startProxy(t, o.CAFile, proxyOpts{auth: true})
	dom := dumpDOM(t, chromium, p.URL(proxyUser, proxyPassword), o.URL+"/page.html", nil,
		"--ignore-certificate-errors-spki-list="+p.SPKI)
	challenged := metric(t, p, "onceproxy_auth_failures_total")
	t.Logf("chromium --proxy-server=http://user:pass@...: %d bytes of DOM, origin got %d requests, %v 407s",
		len(dom), len(o.requests()), challenged)
	if strings.Contains(dom, "Loaded through onceproxy") || challenged != 0 || p.stats(t).Requests != 0 {
		t.Errorf("Chromium used a --proxy-server with credentials (%v 407s): the README must change", challenged)
	}
}
