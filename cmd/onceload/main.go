// Command onceload sends concurrent requests through onceproxy and reports
// throughput, latency percentiles and how the proxy answered (its X-Cache
// header: HIT, COALESCED, MISS or BYPASS).
//
// Unless -target is given, onceload starts its own HTTPS origin on
// 127.0.0.1. The origin's certificate is kept in -origin-cert-dir
// ($TMPDIR/onceload by default), so a proxy told once to trust it keeps
// trusting it across runs. onceload trusts the proxy's MITM CA (-ca,
// certs/ca.pem).
//
// Run an origin alone on a fixed port, then start onceproxy (from the
// repository root, in another terminal) with the variable it prints:
//
//	go run ./cmd/onceload -serve-origin -origin-addr 127.0.0.1:9443
//	ONCEPROXY_UPSTREAM_CA_FILES='[/tmp/onceload/origin.pem]' go run .
//
// Then a stampede (10000 requests for a single URL) and hot keys (the same
// load over 100 URLs), each against an origin onceload starts itself:
//
//	go run ./cmd/onceload -k 1 -n 10000 -c 100
//	go run ./cmd/onceload -k 100 -n 10000 -c 100
//
// With -repeat 8 -k 1000, each of 1000 URLs is asked for 8 times at once:
// a stampede per URL, one MISS and seven COALESCED each.
//
// Add -target https://127.0.0.1:9443 to aim at the -serve-origin one
// instead. The exit status is 1 if any request failed or got a status of
// 400 or more, and 2 for invalid flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/loadgen"
	"github.com/seed-a3c387e8/onceproxy/internal/redact"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// After the first signal, restore the default handling so that a second
	// one kills the process even if draining hangs.
	context.AfterFunc(ctx, stop)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// config holds the parsed flags.
type config struct {
	proxy   *url.URL // nil: direct
	caFile  string
	n, c, k int
	repeat  int
	h2      bool
	timeout time.Duration
	target  string // base URL; "" starts an origin

	origin      loadgen.OriginOptions
	serveOrigin bool

	// The comparisons with a plain goproxy MITM (compare.go) and of hits
	// with going direct (hits.go).
	servePlain    bool
	plainAddr     string
	plainOriginCA string
	plainCAOut    string
	compare       bool
	compareHits   bool
	onceproxyBin  string
	onceproxyEnv  string
	plainH2       bool
	fill          int
	// compareLatency is -compare's origins' delay before each response.
	compareLatency time.Duration
}

// usageError marks an error in the command line (exit status 2).
type usageError struct{ error }

func parseFlags(args []string, stderr io.Writer) (*config, error) {
	flags := flag.NewFlagSet("onceload", flag.ContinueOnError)
	flags.SetOutput(stderr)
	flags.Usage = func() {
		fmt.Fprint(flags.Output(), `usage: onceload [flags]

Sends -n requests at concurrency -c through onceproxy, round-robin over -k
URLs <target>/item/<i>?q=<i>, and reports latency and X-Cache counts. Without
-target it starts an origin on loopback; -serve-origin runs only that origin.

`)
		flags.PrintDefaults()
	}

	var (
		cfg   config
		proxy string
	)
	flags.StringVar(&proxy, "proxy", "http://127.0.0.1:8080", `forward proxy URL; "" or "direct" for none`)
	flags.StringVar(&cfg.caFile, "ca", "certs/ca.pem", "PEM file of the proxy's MITM CA (ignored when -proxy is direct)")
	flags.IntVar(&cfg.n, "n", 10000, "total number of requests")
	flags.IntVar(&cfg.c, "c", 100, "number of concurrent workers")
	flags.IntVar(&cfg.k, "k", 1, "number of distinct URLs (1: every request is the same, a stampede)")
	flags.IntVar(&cfg.repeat, "repeat", 1, "requests per URL in a row before the next (with -c >= -repeat, a stampede on each URL)")
	flags.BoolVar(&cfg.h2, "h2", false, "offer HTTP/2 on TLS connections (the proxy's MITM, or a TLS target when direct)")
	flags.DurationVar(&cfg.timeout, "timeout", 30*time.Second, "per-request timeout, body included (0: none)")
	flags.StringVar(&cfg.target, "target", "", "base URL of the origin (default: start one)")
	flags.BoolVar(&cfg.origin.TLS, "origin-tls", true, "started origin serves HTTPS (HTTP/1.1 and HTTP/2)")
	flags.DurationVar(&cfg.origin.Latency, "origin-latency", 200*time.Millisecond, "started origin's delay before each response")
	flags.IntVar(&cfg.origin.BodySize, "origin-size", 2048, "started origin's response body size in bytes")
	flags.StringVar(&cfg.origin.Addr, "origin-addr", "127.0.0.1:0", "started origin's listen address")
	flags.StringVar(&cfg.origin.CertDir, "origin-cert-dir", filepath.Join(os.TempDir(), "onceload"),
		`directory keeping the origin's origin.pem and origin-key.pem, also trusted for a direct https -target ("": new in-memory certificate each run)`)
	flags.BoolVar(&cfg.serveOrigin, "serve-origin", false, "only run the origin, print how to make onceproxy trust it, and serve until interrupted")
	flags.BoolVar(&cfg.compareHits, "compare-hits", false, "compare hits through onceproxy (-onceproxy) with the same requests sent directly to the origin: -n requests over -k hot keys at -c each way, https and http, in alternating rounds; req/s and their ratio, the HIT share, p50 and p99")
	flags.BoolVar(&cfg.compare, "compare", false, "compare onceproxy (-onceproxy) with a plain goproxy MITM: -n unique https URLs at -c through each, in alternating rounds, over HTTP/1.1 and HTTP/2 (HTTP/2 clients also against a goproxy that answers them over HTTP/2), then -n unique plain http URLs; req/s, CPU per request, latency")
	flags.IntVar(&cfg.fill, "fill", 0, "with -compare: this many unique misses through each proxy before the measured ones, to measure onceproxy with its cache full (120000 fills the shipped 256 MiB with the default 2 KiB pages)")
	flags.DurationVar(&cfg.compareLatency, "compare-latency", 0, "with -compare: the origins' delay before each response (0: none, which measures the proxies' own work; a real site's 100-500ms keeps every miss waiting, as in production: raise -c with it)")
	flags.StringVar(&cfg.onceproxyBin, "onceproxy", "", "with -compare and -compare-hits: the onceproxy binary to run (go build -o /tmp/onceproxy .)")
	flags.StringVar(&cfg.onceproxyEnv, "onceproxy-env", "", "with -compare and -compare-hits: extra KEY=VALUE,... for onceproxy (ONCEPROXY_UPSTREAM_FINGERPRINT=go, say)")
	flags.BoolVar(&cfg.servePlain, "serve-plain-mitm", false, "only run the plain goproxy MITM baseline, until interrupted")
	flags.StringVar(&cfg.plainAddr, "plain-addr", "127.0.0.1:0", "with -serve-plain-mitm: its listen address")
	flags.StringVar(&cfg.plainOriginCA, "plain-origin-ca", "", "with -serve-plain-mitm: a PEM file trusted for origins")
	flags.BoolVar(&cfg.plainH2, "plain-h2", false, "with -serve-plain-mitm: serve HTTP/2 clients over HTTP/2 (goproxy's AllowHTTP2)")
	flags.StringVar(&cfg.plainCAOut, "plain-ca-out", "", "with -serve-plain-mitm: where to write its MITM CA")

	if err := flags.Parse(args); err != nil {
		return nil, err // already reported by fs
	}
	if flags.NArg() > 0 {
		return nil, usageError{fmt.Errorf("unexpected arguments: %q", flags.Args())}
	}
	if cfg.fill < 0 {
		return nil, usageError{errors.New("-fill must not be negative")}
	}
	if cfg.n < 1 || cfg.c < 1 || cfg.k < 1 || cfg.repeat < 1 {
		return nil, usageError{errors.New("-n, -c, -k and -repeat must be at least 1")}
	}
	if cfg.timeout < 0 || cfg.origin.Latency < 0 || cfg.origin.BodySize < 0 || cfg.compareLatency < 0 {
		return nil, usageError{errors.New("-timeout, -origin-latency, -origin-size and -compare-latency must not be negative")}
	}
	if cfg.serveOrigin && cfg.target != "" {
		return nil, usageError{errors.New("-serve-origin and -target are mutually exclusive")}
	}
	if !cfg.origin.TLS {
		cfg.origin.CertDir = ""
	}
	var err error
	if cfg.proxy, err = parseProxy(proxy); err != nil {
		return nil, usageError{err}
	}
	if cfg.target != "" {
		if cfg.target, err = parseBase(cfg.target); err != nil {
			return nil, usageError{err}
		}
	}
	return &cfg, nil
}

// parseProxy parses the -proxy flag. A bare host:port means http://host:port.
func parseProxy(s string) (*url.URL, error) {
	if s == "" || s == "direct" {
		return nil, nil
	}
	if !strings.Contains(s, "://") {
		s = "http://" + s
	}
	u, err := url.Parse(s)
	if err != nil {
		return nil, fmt.Errorf("-proxy: %w", err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("-proxy %q: want http://host:port", s)
	}
	return u, nil
}

// parseBase checks the -target flag and drops a trailing slash.
func parseBase(s string) (string, error) {
	u, err := url.Parse(s)
	if err != nil {
		return "", fmt.Errorf("-target: %w", err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
		return "", fmt.Errorf("-target %q: want a base URL such as https://127.0.0.1:9443, without query", s)
	}
	return strings.TrimSuffix(s, "/"), nil
}

// run is main without the process: it returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		if ue, ok := errors.AsType[usageError](err); ok {
			fmt.Fprintf(stderr, "onceload: %v\n", ue.error)
		}
		return 2
	}
	switch {
	case cfg.serveOrigin:
		return serveOrigin(ctx, cfg, stdout, stderr)
	case cfg.servePlain:
		return servePlainMITM(ctx, cfg, stdout, stderr)
	case cfg.compare:
		return compareWithPlainMITM(ctx, cfg, stdout, stderr)
	case cfg.compareHits:
		return compareHits(ctx, cfg, stdout, stderr)
	}
	return load(ctx, cfg, stdout, stderr)
}

// trustHint tells how to make onceproxy trust origin's certificate.
func trustHint(origin *loadgen.Origin) string {
	if origin.CAFile() == "" {
		return "plain HTTP, no CA needed"
	}
	return fmt.Sprintf("start onceproxy with ONCEPROXY_UPSTREAM_CA_FILES='[%s]'", origin.CAFile())
}

func serveOrigin(ctx context.Context, cfg *config, stdout, stderr io.Writer) int {
	origin, err := loadgen.StartOrigin(cfg.origin)
	if err != nil {
		fmt.Fprintf(stderr, "onceload: %v\n", err)
		return 1
	}
	fmt.Fprintf(stdout, "origin:  %s (latency %v, body %d B)\n", origin.URL(), cfg.origin.Latency, cfg.origin.BodySize)
	if ca := origin.CAFile(); ca != "" {
		fmt.Fprintf(stdout, "CA file: %s\n", ca)
	}
	fmt.Fprintf(stdout, "proxy:   %s\n", trustHint(origin))
	fmt.Fprintln(stdout, "serving until interrupted")
	<-ctx.Done()
	origin.Close()
	fmt.Fprintf(stdout, "origin requests: %d\n", origin.Requests())
	return 0
}

func load(ctx context.Context, cfg *config, stdout, stderr io.Writer) int {
	base := cfg.target
	var origin *loadgen.Origin
	if base == "" {
		var err error
		if origin, err = loadgen.StartOrigin(cfg.origin); err != nil {
			fmt.Fprintf(stderr, "onceload: %v\n", err)
			return 1
		}
		defer origin.Close()
		base = origin.URL()
	}
	// The run sends requests i*repeat to i*repeat+repeat-1 to URL i (mod
	// k): past n/repeat URLs none is ever sent, and -k 100000000 would
	// otherwise build gigabytes of them before the first request.
	targets := make([]string, min(cfg.k, (cfg.n+cfg.repeat-1)/cfg.repeat))
	for i := range targets {
		targets[i] = fmt.Sprintf("%s/item/%d?q=%d", base, i, i)
	}
	isTLS := strings.HasPrefix(base, "https://")

	caFile := ""
	switch {
	case cfg.proxy == nil && origin != nil:
		caFile = origin.CAFile() // direct to our own origin
	case cfg.proxy == nil && isTLS && cfg.origin.CertDir != "":
		// Direct to a -target: trust the certificate a -serve-origin run
		// keeps in the same directory, if there is one.
		if ca := filepath.Join(cfg.origin.CertDir, "origin.pem"); fileExists(ca) {
			caFile = ca
		}
	case cfg.proxy != nil && isTLS && cfg.caFile != "":
		if _, err := os.Stat(cfg.caFile); errors.Is(err, fs.ErrNotExist) {
			fmt.Fprintf(stderr, "hint: proxy CA file %s not found; start onceproxy once to create it, or pass -ca (HTTPS through the proxy will fail verification)\n", cfg.caFile)
		} else {
			caFile = cfg.caFile
		}
	}

	via, proto := "direct", "HTTP/1.1"
	if cfg.proxy != nil {
		via = "via " + redact.ParsedURL(cfg.proxy)
	}
	if cfg.h2 && isTLS {
		proto = "HTTP/2 offered"
	}
	fmt.Fprintf(stdout, "onceload: %d requests, concurrency %d, %d URL(s) like %s, %s, %s\n",
		cfg.n, cfg.c, len(targets), targets[0], via, proto)
	if origin != nil {
		fmt.Fprintf(stdout, "origin:   %s (latency %v, body %d B); %s\n",
			origin.URL(), cfg.origin.Latency, cfg.origin.BodySize, trustHint(origin))
	}

	res, runErr := loadgen.Run(ctx, loadgen.Options{
		Proxy:   cfg.proxy,
		CAFile:  caFile,
		Targets: targets,
		N:       cfg.n,
		C:       cfg.c,
		HTTP2:   cfg.h2,
		Timeout: cfg.timeout,
		Repeat:  cfg.repeat,
	})
	if res == nil {
		fmt.Fprintf(stderr, "onceload: %v\n", runErr)
		return 1
	}
	fmt.Fprintln(stdout, res)
	if origin != nil {
		seen := origin.Requests()
		fmt.Fprintf(stdout, "origin requests: %d (of %d)\n", seen, res.Requests)
		if seen == 0 && cfg.proxy != nil && origin.CAFile() != "" && serverErrors(res) > 0 {
			// The proxy answered, but never reached the origin: most
			// likely it does not trust the origin's certificate.
			fmt.Fprintf(stderr, "hint: the origin saw no request; does onceproxy trust it? %s\n", trustHint(origin))
		}
	}
	if runErr != nil {
		fmt.Fprintf(stderr, "onceload: %v\n", runErr)
		return 1
	}
	if bad := failed(res); bad > 0 {
		fmt.Fprintf(stderr, "onceload: %d of %d requests failed or got a status >= 400\n", bad, res.Requests)
		return 1
	}
	return 0
}

// failed counts the requests that got no response or an error status.
func failed(res *loadgen.Result) int {
	bad := res.Errors
	for code, count := range res.Status {
		if code >= 400 {
			bad += count
		}
	}
	return bad
}

// serverErrors counts the responses with a 5xx status.
func serverErrors(res *loadgen.Result) int {
	n := 0
	for code, count := range res.Status {
		if code >= 500 {
			n += count
		}
	}
	return n
}

func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
