package e2e

import (
	"encoding/pem"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"
)

// origin is a loopback HTTPS site (HTTP/2 on) that counts every request
// reaching it. onceproxy trusts its certificate through upstream.ca_files.
type origin struct {
	srv    *httptest.Server
	URL    string // https://127.0.0.1:port
	Plain  string // http://127.0.0.1:port2, the same site without TLS
	CAFile string
	delay  time.Duration // before each answer, so duplicates overlap in flight

	mu   sync.Mutex
	reqs []originReq
}

// originReq is one request the origin received.
type originReq struct {
	Path, RawQuery, Proto string
	Header                http.Header
}

// The page a browser loads: the same stylesheet, script and image 20 times
// each, an image under five URLs that differ only in tracking parameters
// (one key for onceproxy, five URLs for the browser), five distinct images,
// and a fetch() of the shared image (another Accept header: another key).
const dupCount = 20

func pageHTML() string {
	var b strings.Builder
	b.WriteString("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>onceproxy e2e page</title>\n")
	for range dupCount {
		b.WriteString("<link rel=\"stylesheet\" href=\"/static/site.css\">\n")
	}
	for range dupCount {
		b.WriteString("<script src=\"/static/app.js\"></script>\n")
	}
	// A stylesheet with a validator that must be revalidated on every use.
	b.WriteString("<link rel=\"stylesheet\" href=\"/static/etag.css\">\n")
	b.WriteString("</head><body><h1 id=\"title\">Loaded through onceproxy</h1>\n")
	for range dupCount {
		b.WriteString("<img class=\"dup\" src=\"/static/logo.svg\" width=\"16\" height=\"16\">\n")
	}
	for _, q := range []string{
		"utm_source=a", "utm_source=b&utm_medium=mail", "utm_medium=mail&utm_source=c",
		"gclid=123", "fbclid=xyz&utm_campaign=spring",
	} {
		fmt.Fprintf(&b, "<img class=\"tracked\" src=\"/static/tracked.svg?%s\" width=\"16\" height=\"16\">\n", q)
	}
	for i := 1; i <= 5; i++ {
		fmt.Fprintf(&b, "<img class=\"distinct\" src=\"/static/p%d.svg\" width=\"16\" height=\"16\">\n", i)
	}
	b.WriteString(`<p id="fetched">pending</p>
<script>
fetch('/static/logo.svg').then(r => r.text()).then(t => {
  document.getElementById('fetched').textContent = 'fetched ' + t.length + ' bytes';
}).catch(e => { document.getElementById('fetched').textContent = 'fetch failed: ' + e; });
</script>
</body></html>
`)
	return b.String()
}

const svg = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16"><rect width="16" height="16" fill="#17803d"/></svg>`

func startOrigin(t *testing.T, delay time.Duration) *origin {
	t.Helper()
	o := &origin{delay: delay}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /page.html", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		fmt.Fprint(w, pageHTML())
	})
	mux.HandleFunc("GET /static/site.css", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/css")
		fmt.Fprint(w, "body{font-family:sans-serif} h1{color:#17803d}\n")
	})
	mux.HandleFunc("GET /static/etag.css", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("ETag", `"v1"`)
		w.Header().Set("Cache-Control", "no-cache")
		if r.Header.Get("If-None-Match") == `"v1"` {
			w.WriteHeader(http.StatusNotModified)
			return
		}
		w.Header().Set("Content-Type", "text/css")
		fmt.Fprint(w, "p{margin:0}\n")
	})
	mux.HandleFunc("GET /static/app.js", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/javascript")
		fmt.Fprint(w, "window.appRuns = (window.appRuns || 0) + 1;\n")
	})
	mux.HandleFunc("GET /static/{name}", func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasSuffix(r.PathValue("name"), ".svg") {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "image/svg+xml")
		fmt.Fprint(w, svg)
	})
	mux.HandleFunc("GET /data/{id}", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		fmt.Fprintf(w, "item %s\n", r.PathValue("id"))
	})
	mux.HandleFunc("GET /hello", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		fmt.Fprintf(w, "hello over %s\n", r.Proto)
	})
	counted := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		o.mu.Lock()
		o.reqs = append(o.reqs, originReq{Path: r.URL.Path, RawQuery: r.URL.RawQuery, Proto: r.Proto, Header: r.Header.Clone()})
		o.mu.Unlock()
		if o.delay > 0 {
			select {
			case <-time.After(o.delay):
			case <-r.Context().Done():
				return
			}
		}
		mux.ServeHTTP(w, r)
	})
	o.srv = httptest.NewUnstartedServer(counted)
	// Clients that drop a connection mid-handshake (onceproxy's SOCKS5
	// port dials first, then intercepts) are no news.
	o.srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	o.srv.EnableHTTP2 = true
	o.srv.StartTLS()
	t.Cleanup(o.srv.Close)
	o.URL = o.srv.URL
	plain := httptest.NewServer(counted)
	t.Cleanup(plain.Close)
	o.Plain = plain.URL
	o.CAFile = filepath.Join(t.TempDir(), "origin-ca.pem")
	pemBytes := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: o.srv.Certificate().Raw})
	if err := os.WriteFile(o.CAFile, pemBytes, 0o644); err != nil {
		t.Fatal(err)
	}
	return o
}

// requests returns a copy of what reached the origin.
func (o *origin) requests() []originReq {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]originReq(nil), o.reqs...)
}

// countByPath counts origin requests per path (query ignored).
func (o *origin) countByPath() map[string]int {
	n := map[string]int{}
	for _, r := range o.requests() {
		n[r.Path]++
	}
	return n
}

// describe lists what reached the origin, for the test log.
func (o *origin) describe() string {
	var lines []string
	for _, r := range o.requests() {
		u := r.Path
		if r.RawQuery != "" {
			u += "?" + r.RawQuery
		}
		cond := ""
		for _, h := range []string{"If-None-Match", "If-Modified-Since", "Cache-Control", "Pragma"} {
			if v := r.Header.Get(h); v != "" {
				cond += fmt.Sprintf(" %s=%q", h, v)
			}
		}
		lines = append(lines, fmt.Sprintf("%s %s Accept=%q%s", r.Proto, u, r.Header.Get("Accept"), cond))
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}
