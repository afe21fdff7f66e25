package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/loadgen"
)

// runArgs runs the command with args and returns its exit status and output.
func runArgs(t *testing.T, ctx context.Context, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut strings.Builder
	code = run(ctx, args, &out, &errOut)
	return code, out.String(), errOut.String()
}

func TestHelp(t *testing.T) {
	code, _, stderr := runArgs(t, context.Background(), "-h")
	if code != 0 || !strings.Contains(stderr, "usage: onceload") || !strings.Contains(stderr, "-serve-origin") {
		t.Errorf("-h: exit %d, stderr:\n%s\nwant exit 0 and the usage", code, stderr)
	}
}

func TestBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-n", "0"},
		{"-c", "-1"},
		{"-repeat", "0"},
		{"-compare", "-fill", "-1"},
		{"-compare", "-compare-latency", "-1ms"},
		{"-origin-latency", "-1s"},
		{"-serve-origin", "-target", "http://127.0.0.1:1"},
		{"-proxy", "socks5://127.0.0.1:1080"},
		{"-target", "http://127.0.0.1:1/?q=1"},
		{"-target", "/relative"},
		{"-no-such-flag"},
		{"extra"},
	} {
		if code, _, stderr := runArgs(t, context.Background(), args...); code != 2 {
			t.Errorf("%q: exit %d, want 2; stderr:\n%s", args, code, stderr)
		}
	}
}

func TestParseProxy(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"", ""},
		{"direct", ""},
		{"127.0.0.1:8080", "http://127.0.0.1:8080"},
		{"http://127.0.0.1:8080", "http://127.0.0.1:8080"},
		{"https://[::1]:8443", "https://[::1]:8443"},
	} {
		u, err := parseProxy(tc.in)
		if err != nil {
			t.Errorf("parseProxy(%q): %v", tc.in, err)
			continue
		}
		got := ""
		if u != nil {
			got = u.String()
		}
		if got != tc.want {
			t.Errorf("parseProxy(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestLoadDirect(t *testing.T) {
	for _, tls := range []string{"true", "false"} {
		t.Run("tls="+tls, func(t *testing.T) {
			code, stdout, stderr := runArgs(t, context.Background(),
				"-proxy", "direct", "-n", "30", "-c", "5", "-k", "3",
				"-origin-tls="+tls, "-origin-latency", "0", "-origin-size", "10",
				"-origin-cert-dir", t.TempDir())
			if code != 0 {
				t.Fatalf("exit %d, want 0\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
			}
			for _, want := range []string{
				"requests 30 in",
				"status   200=30",
				"x-cache  -=30",
				"read     300 B",
				"origin requests: 30 (of 30)",
			} {
				if !strings.Contains(stdout, want) {
					t.Errorf("stdout lacks %q:\n%s", want, stdout)
				}
			}
		})
	}
}

// TestHugeKBuildsOnlyTheURLsSent: -k far beyond -n builds the n URLs
// the run sends, not k of them (a billion would not fit in memory).
func TestHugeKBuildsOnlyTheURLsSent(t *testing.T) {
	code, stdout, stderr := runArgs(t, context.Background(),
		"-proxy", "direct", "-n", "12", "-c", "3", "-k", "1000000000", "-repeat", "4",
		"-origin-tls=false", "-origin-latency", "0", "-origin-size", "10", "-origin-cert-dir", t.TempDir())
	if code != 0 {
		t.Fatalf("exit %d, want 0\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	for _, want := range []string{"12 requests, concurrency 3, 3 URL(s) like", "requests 12 in", "status   200=12"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("stdout lacks %q:\n%s", want, stdout)
		}
	}
}

// TestLoadViaProxy uses a fake proxy that answers every absolute-form
// request itself with X-Cache: HIT, so the origin sees nothing.
func TestLoadViaProxy(t *testing.T) {
	var proxied atomic.Int64
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !r.URL.IsAbs() {
			http.Error(w, "want an absolute-form request", http.StatusBadRequest)
			return
		}
		proxied.Add(1)
		w.Header().Set("X-Cache", "HIT")
	}))
	t.Cleanup(proxy.Close)

	code, stdout, stderr := runArgs(t, context.Background(),
		"-proxy", proxy.URL, "-n", "12", "-c", "3", "-origin-tls=false")
	if code != 0 {
		t.Fatalf("exit %d, want 0\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	for _, want := range []string{"x-cache  HIT=12", "origin requests: 0 (of 12)"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("stdout lacks %q:\n%s", want, stdout)
		}
	}
	if g := proxied.Load(); g != 12 {
		t.Errorf("proxy saw %d requests, want 12", g)
	}
}

// TestLoadFailureExit checks that failures give exit status 1, and the hints
// for a missing proxy CA file and an origin the proxy cannot reach.
func TestLoadFailureExit(t *testing.T) {
	// A proxy that cannot reach anything: 502 for CONNECT and the rest.
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "no upstream", http.StatusBadGateway)
	}))
	t.Cleanup(proxy.Close)
	dir := t.TempDir()

	t.Run("https", func(t *testing.T) {
		code, stdout, stderr := runArgs(t, context.Background(),
			"-proxy", proxy.URL, "-n", "4", "-c", "2", "-origin-latency", "0",
			"-ca", filepath.Join(dir, "missing.pem"), "-origin-cert-dir", dir)
		if code != 1 {
			t.Errorf("exit %d, want 1\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
		}
		if !strings.Contains(stderr, "hint: proxy CA file") {
			t.Errorf("stderr lacks the missing-CA hint:\n%s", stderr)
		}
		if !strings.Contains(stdout, "4 errors") {
			t.Errorf("stdout does not report 4 errors:\n%s", stdout)
		}
	})

	t.Run("http", func(t *testing.T) {
		code, stdout, stderr := runArgs(t, context.Background(),
			"-proxy", proxy.URL, "-n", "4", "-c", "2", "-origin-tls=false", "-origin-latency", "0")
		if code != 1 {
			t.Errorf("exit %d, want 1\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
		}
		if !strings.Contains(stdout, "status   502=4") {
			t.Errorf("stdout lacks the 502 count:\n%s", stdout)
		}
		if strings.Contains(stderr, "hint: proxy CA file") {
			t.Errorf("missing-CA hint printed for a plain HTTP target:\n%s", stderr)
		}
	})
}

func TestServeOrigin(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // serve until interrupted: here, at once
	code, stdout, stderr := runArgs(t, ctx, "-serve-origin", "-origin-cert-dir", dir)
	if code != 0 {
		t.Fatalf("exit %d, want 0\nstderr:\n%s", code, stderr)
	}
	want := "ONCEPROXY_UPSTREAM_CA_FILES='[" + filepath.Join(dir, "origin.pem") + "]'"
	for _, w := range []string{"origin:  https://127.0.0.1:", want, "origin requests: 0"} {
		if !strings.Contains(stdout, w) {
			t.Errorf("stdout lacks %q:\n%s", w, stdout)
		}
	}
}

// TestLoadDirectToServedOrigin runs an origin as -serve-origin would, then
// loads it directly with -target: the certificate in -origin-cert-dir is
// trusted without -ca.
func TestLoadDirectToServedOrigin(t *testing.T) {
	dir := t.TempDir()
	origin, err := loadgen.StartOrigin(loadgen.OriginOptions{TLS: true, CertDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(origin.Close)

	code, stdout, stderr := runArgs(t, context.Background(),
		"-proxy", "direct", "-target", origin.URL()+"/", "-n", "6", "-c", "2", "-k", "2",
		"-origin-cert-dir", dir)
	if code != 0 {
		t.Fatalf("exit %d, want 0\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	if strings.Contains(stdout, "origin requests:") {
		t.Errorf("origin line printed for a -target run:\n%s", stdout)
	}
	if g := origin.RequestsFor("/item/1"); g != 3 {
		t.Errorf("origin RequestsFor(/item/1) = %d, want 3", g)
	}
}

// TestCompareRuns: onceload -compare starts both proxies, sends the load
// through each, and prints both rows; onceload -compare-hits prints a row
// per scheme whose proxied answers were all hits (the tools work; their
// numbers are a benchmark's business).
func TestCompareRuns(t *testing.T) {
	if testing.Short() {
		t.Skip("builds two binaries")
	}
	dir := t.TempDir()
	bin, self := filepath.Join(dir, "onceproxy"), filepath.Join(dir, "onceload")
	for _, build := range [][]string{{"-o", bin, "../.."}, {"-o", self, "."}} {
		if out, err := exec.Command("go", append([]string{"build"}, build...)...).CombinedOutput(); err != nil {
			t.Fatalf("go build %v: %v\n%s", build, err, out)
		}
	}
	out, err := exec.Command(self, "-compare", "-onceproxy", bin, "-n", "200", "-c", "8").CombinedOutput()
	if err != nil {
		t.Fatalf("onceload -compare: %v\n%s", err, out)
	}
	for _, want := range []string{"unique https misses, HTTP/1.1 clients", "unique https misses, HTTP/2 clients", "unique http misses, HTTP/1.1 clients", "onceproxy", "goproxy", "goproxy-h2", "CPU/req vs goproxy-h2", "CPU/req", "faults/req"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}

	// -compare-hits: both schemes, every answer through the proxy a HIT
	// once the keys are warm.
	out, err = exec.Command(self, "-compare-hits", "-onceproxy", bin, "-n", "500", "-k", "10", "-c", "8").CombinedOutput()
	if err != nil {
		t.Fatalf("onceload -compare-hits: %v\n%s", err, out)
	}
	rows := 0
	for line := range strings.Lines(string(out)) {
		f := strings.Fields(line)
		if len(f) == 9 && (f[0] == "https" || f[0] == "http") {
			rows++
			if f[4] != "100.0%" {
				t.Errorf("%s: HIT share %s, want 100.0%%\n%s", f[0], f[4], out)
			}
			// p50 direct, p50 onceproxy, p99 direct, p99 onceproxy.
			var lat [4]time.Duration
			for i := range lat {
				if lat[i], err = time.ParseDuration(f[5+i]); err != nil || lat[i] <= 0 {
					t.Errorf("%s: latency column %d is %q (%v)\n%s", f[0], 5+i, f[5+i], err, out)
				}
			}
			if lat[2] < lat[0] || lat[3] < lat[1] {
				t.Errorf("%s: p99 below p50\n%s", f[0], out)
			}
		}
	}
	if rows != 2 {
		t.Errorf("want a row for https and one for http:\n%s", out)
	}
}

// TestComparisonRatios: each row is compared with every baseline named,
// the baseline with itself at 1.00x.
func TestComparisonRatios(t *testing.T) {
	res := func(rps float64, n int) *loadgen.Result {
		return &loadgen.Result{Requests: n, RPS: rps, Protos: map[string]int{"HTTP/2.0": n}}
	}
	ms := []measured{
		{name: nameOnceproxy, res: res(900, 100), used: loadgen.Usage{CPU: 10 * time.Millisecond, MinorFaults: 175}},
		{name: nameGoproxyH2, res: res(1000, 100), used: loadgen.Usage{CPU: 8 * time.Millisecond}},
		{name: nameGoproxy, res: res(1200, 100), used: loadgen.Usage{CPU: 5 * time.Millisecond}},
	}
	if r := ratios(ms, nameOnceproxy, nameGoproxyH2); r.rps != 0.9 || r.cpu != 1.25 {
		t.Errorf("onceproxy vs goproxy-h2 = %+v, want 0.9 and 1.25", r)
	}
	if r := ratios(ms, nameGoproxy, nameGoproxy); r.rps != 1 || r.cpu != 1 {
		t.Errorf("goproxy vs itself = %+v, want 1 and 1", r)
	}
	var b strings.Builder
	printComparison(&b, "title", ms, []string{nameGoproxyH2, nameGoproxy})
	for _, want := range []string{"req/s vs goproxy-h2", "CPU/req vs goproxy", "faults/req", "1.75", "0.90x", "1.25x", "2.00x", "1.00x"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, b.String())
		}
	}
}
