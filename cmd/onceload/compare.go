package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/loadgen"
)

// A comparison runs the same load through several proxies, each a process
// of its own so that the CPU it spends can be read from /proc, against the
// same loopback origin, and reports req/s, CPU per request and latency side
// by side. onceload -compare runs onceproxy against a plain goproxy MITM
// (loadgen.PlainMITM, onceload -serve-plain-mitm); BenchmarkVsPlainMITM
// runs the same comparison as a Go benchmark.

// contender is one proxy under comparison.
type contender struct {
	name   string
	proxy  *url.URL
	caFile string // its MITM CA
	pid    int    // its process, for the CPU it spends
}

// measured is what one contender did with one load.
type measured struct {
	name string
	res  *loadgen.Result
	used loadgen.Usage // the proxy's CPU and minor page faults over the load
}

// cpuPerRequest is the contender's CPU time per answered request.
func (m measured) cpuPerRequest() time.Duration {
	if m.res.Requests == 0 {
		return 0
	}
	return m.used.CPU / time.Duration(m.res.Requests)
}

// faultsPerRequest is the contender's minor page faults per answered
// request.
func (m measured) faultsPerRequest() float64 {
	if m.res.Requests == 0 {
		return 0
	}
	return float64(m.used.MinorFaults) / float64(m.res.Requests)
}

// missRounds is how many rounds a miss comparison runs: each contender
// serves its share of every round, in an order that turns from one round
// to the next, so that the machine's drift over seconds and whatever
// running first or last costs fall on every contender alike.
const missRounds = 8

// sendMisses sends n requests at concurrency c through ct, each to a URL
// of its own under base (stamp and round keep runs and rounds apart), and
// fails if any request failed.
func sendMisses(ctx context.Context, ct contender, base, stamp, round string, n, c int, h2 bool) (*loadgen.Result, error) {
	targets := make([]string, n)
	for i := range targets {
		targets[i] = fmt.Sprintf("%s/u/%s/%s/%s/%d", base, ct.name, stamp, round, i)
	}
	return runChecked(ctx, ct.name, loadgen.Options{Proxy: ct.proxy, CAFile: ct.caFile, Targets: targets, N: n, C: c, HTTP2: h2, Timeout: 30 * time.Second})
}

// runChecked runs opts and fails, naming what it measured, if any request
// failed: a comparison of runs with failures would compare failures.
func runChecked(ctx context.Context, name string, opts loadgen.Options) (*loadgen.Result, error) {
	res, err := loadgen.Run(ctx, opts)
	if err != nil {
		return nil, err
	}
	if bad := failed(res); bad > 0 {
		return nil, fmt.Errorf("%s: %d of %d requests failed (%q, statuses %v)", name, bad, res.Requests, res.ErrorSamples, res.Status)
	}
	return res, nil
}

// missLoad sends o.n requests, every URL new (a miss for a cache), at
// concurrency o.c through each contender: first a warm-up (connections,
// certificates), then o.n measured, in missRounds alternating rounds.
func missLoad(ctx context.Context, cs []contender, base string, o comparison, h2 bool) ([]measured, error) {
	n, c := o.n, o.c
	stamp := fmt.Sprint(time.Now().UnixNano())
	send := func(ct contender, round string, n int) (*loadgen.Result, error) {
		return sendMisses(ctx, ct, base, stamp, round, n, c, h2)
	}
	for _, ct := range cs {
		if _, err := send(ct, "warm", max(n/10, c)); err != nil {
			return nil, err
		}
	}
	per := max(n/missRounds, c)
	runs := make([][]*loadgen.Result, len(cs))
	used := make([]loadgen.Usage, len(cs))
	for r := range missRounds {
		for j := range cs {
			i := (j + r) % len(cs)
			before, err := loadgen.ProcessUsage(cs[i].pid)
			if err != nil {
				return nil, err
			}
			res, err := send(cs[i], fmt.Sprint(r), per)
			if err != nil {
				return nil, err
			}
			after, err := loadgen.ProcessUsage(cs[i].pid)
			if err != nil {
				return nil, err
			}
			runs[i] = append(runs[i], res)
			used[i].CPU += after.CPU - before.CPU
			used[i].MinorFaults += after.MinorFaults - before.MinorFaults
		}
	}
	out := make([]measured, len(cs))
	for i, ct := range cs {
		out[i] = measured{name: ct.name, res: loadgen.Merge(runs[i]...), used: used[i]}
	}
	return out, nil
}

// printComparison writes ms as a table with, for each of its baselines
// (contenders named in base), the ratios of req/s and of CPU per request
// against it.
func printComparison(w io.Writer, title string, ms []measured, base []string) {
	fmt.Fprintf(w, "%s\n", title)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	head := "proxy\tclient spoke\treq/s\tCPU/req\tfaults/req\tp50\tp99\t"
	for _, b := range base {
		head += "req/s vs " + b + "\tCPU/req vs " + b + "\t"
	}
	fmt.Fprintln(tw, head)
	for _, m := range ms {
		fmt.Fprintf(tw, "%s\t%s\t%.0f\t%s\t%.2f\t%s\t%s\t", m.name, protos(m.res.Protos), m.res.RPS, m.cpuPerRequest().Round(time.Microsecond),
			m.faultsPerRequest(), m.res.P50.Round(10*time.Microsecond), m.res.P99.Round(10*time.Microsecond))
		for _, b := range base {
			r := ratios(ms, m.name, b)
			fmt.Fprintf(tw, "%.2fx\t%.2fx\t", r.rps, r.cpu)
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
}

// ratio is one contender's req/s and CPU per request over another's.
type ratio struct{ rps, cpu float64 }

// ratios compares the contender named a with the one named b in ms.
func ratios(ms []measured, a, b string) ratio {
	var x, y measured
	for _, m := range ms {
		if m.name == a {
			x = m
		}
		if m.name == b {
			y = m
		}
	}
	if x.res == nil || y.res == nil || y.res.RPS == 0 || y.cpuPerRequest() == 0 {
		return ratio{}
	}
	return ratio{rps: x.res.RPS / y.res.RPS, cpu: float64(x.cpuPerRequest()) / float64(y.cpuPerRequest())}
}

// protos names the protocols the client's responses came over: goproxy's
// MITM answers HTTP/2 clients over HTTP/1.1 unless AllowHTTP2 is set, and
// a comparison should show it.
func protos(counts map[string]int) string {
	names := make([]string, 0, len(counts))
	for p := range counts {
		names = append(names, p)
	}
	sort.Strings(names)
	return strings.Join(names, "+")
}

// child is a proxy process started for a comparison.
type child struct {
	cmd  *exec.Cmd
	addr string
	ca   string
}

func (c *child) stop() {
	_ = c.cmd.Process.Kill()
	_ = c.cmd.Wait()
}

// freeAddr returns a loopback address nothing listens on right now.
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// waitReady waits until addr accepts connections and file ("": none)
// exists.
func waitReady(ctx context.Context, addr, file string) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			if file == "" {
				return nil
			}
			if _, err := os.Stat(file); err == nil {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not come up within 30s", addr)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// startChild starts cmd, a server that listens on addr, and waits until
// it is ready (see waitReady); what names it in errors.
func startChild(ctx context.Context, what string, cmd *exec.Cmd, addr, ca, ready string) (*child, error) {
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", cmd.Path, err)
	}
	c := &child{cmd: cmd, addr: addr, ca: ca}
	if err := waitReady(ctx, addr, ready); err != nil {
		c.stop()
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	return c, nil
}

// startOnceproxy runs the onceproxy binary at bin with its shipped
// defaults, on a free port, trusting originCA, plus env.
func startOnceproxy(ctx context.Context, bin, originCA, dir string, env []string) (*child, error) {
	addr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	certs := filepath.Join(dir, "certs")
	cmd := exec.CommandContext(ctx, bin)
	cmd.Dir = dir // no config.yaml here: the built-in defaults
	cmd.Env = append(append(os.Environ(),
		"ONCEPROXY_PROXY_LISTEN="+addr, "ONCEPROXY_SOCKS5_LISTEN=", "ONCEPROXY_ADMIN_LISTEN=",
		"ONCEPROXY_MITM_CA_DIR="+certs, "ONCEPROXY_UPSTREAM_CA_FILES=["+originCA+"]"), env...)
	// Its log, the access log included (it is on, as shipped), goes to a
	// file, as a production log would.
	logFile, err := os.Create(filepath.Join(dir, "onceproxy.log"))
	if err != nil {
		return nil, err
	}
	defer logFile.Close()
	cmd.Stdout, cmd.Stderr = logFile, logFile
	ca := filepath.Join(certs, "ca.pem")
	return startChild(ctx, "onceproxy", cmd, addr, ca, ca)
}

// startPlainMITM runs `self -serve-plain-mitm` (self is an onceload
// binary) on a free port, trusting originCA; h2 serves HTTP/2 clients
// over HTTP/2 (goproxy's AllowHTTP2).
func startPlainMITM(ctx context.Context, self, originCA, dir string, h2 bool, stderr io.Writer) (*child, error) {
	addr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	ca := filepath.Join(dir, fmt.Sprintf("plain-ca-%t.pem", h2))
	cmd := exec.CommandContext(ctx, self, "-serve-plain-mitm", "-plain-addr", addr, "-plain-origin-ca", originCA, "-plain-ca-out", ca, fmt.Sprintf("-plain-h2=%t", h2))
	cmd.Stdout, cmd.Stderr = io.Discard, stderr
	return startChild(ctx, "plain MITM", cmd, addr, ca, ca)
}

// servePlainMITM is onceload -serve-plain-mitm: the baseline proxy alone,
// until interrupted.
func servePlainMITM(ctx context.Context, cfg *config, stdout, stderr io.Writer) int {
	var cas []string
	if cfg.plainOriginCA != "" {
		cas = []string{cfg.plainOriginCA}
	}
	p, err := loadgen.StartPlainMITM(loadgen.PlainMITMOptions{Addr: cfg.plainAddr, OriginCAFiles: cas, HTTP2: cfg.plainH2})
	if err != nil {
		fmt.Fprintf(stderr, "onceload: %v\n", err)
		return 1
	}
	defer p.Close()
	if cfg.plainCAOut != "" {
		b, err := os.ReadFile(p.CAFile())
		if err == nil {
			err = os.WriteFile(cfg.plainCAOut+".tmp", b, 0o644)
		}
		if err == nil {
			err = os.Rename(cfg.plainCAOut+".tmp", cfg.plainCAOut)
		}
		if err != nil {
			fmt.Fprintf(stderr, "onceload: %v\n", err)
			return 1
		}
	}
	fmt.Fprintf(stdout, "plain goproxy MITM: %s, CA %s\nserving until interrupted\n", p.Addr(), p.CAFile())
	<-ctx.Done()
	return 0
}

// compareWithPlainMITM is onceload -compare: onceproxy (the binary given
// by -onceproxy) against a plain goproxy MITM, on unique https URLs over
// HTTP/1.1 and HTTP/2, and on unique plain http URLs.
func compareWithPlainMITM(ctx context.Context, cfg *config, stdout, stderr io.Writer) int {
	self, code := comparisonBinaries(cfg, "-compare", stderr)
	if code != 0 {
		return code
	}
	rows, err := runComparison(ctx, comparison{bin: cfg.onceproxyBin, self: self, env: envList(cfg.onceproxyEnv),
		n: cfg.n, c: cfg.c, fill: cfg.fill, bodySize: cfg.origin.BodySize, latency: cfg.compareLatency, stderr: stderr})
	if err != nil {
		fmt.Fprintf(stderr, "onceload: %v\n", err)
		return 1
	}
	for _, r := range rows {
		printComparison(stdout, r.title, r.ms, r.base)
		fmt.Fprintln(stdout)
	}
	return 0
}

// comparisonBinaries checks that a comparison (flag) was given the
// onceproxy binary to run, and returns this program's own, which serves
// the comparison's other processes. code is the exit status when not 0.
func comparisonBinaries(cfg *config, flag string, stderr io.Writer) (self string, code int) {
	if cfg.onceproxyBin == "" {
		fmt.Fprintf(stderr, "onceload: %s needs -onceproxy, the path of an onceproxy binary (go build -o /tmp/onceproxy .)\n", flag)
		return "", 2
	}
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "onceload: %v\n", err)
		return "", 1
	}
	return self, 0
}

// comparisonRow is one load's results.
type comparisonRow struct {
	title string
	h2    bool
	// plain sends the load to a plain http origin: absolute-form requests
	// to the proxy, no tunnel, no TLS on either side.
	plain bool
	ms    []measured
	// base names the contenders the others are compared with: for HTTP/2
	// clients first the goproxy that answers them over HTTP/2 too (the same
	// protocol work), then goproxy as shipped, which answers over HTTP/1.1.
	base []string
}

// The contenders' names.
const (
	nameOnceproxy = "onceproxy"
	nameGoproxy   = "goproxy"
	nameGoproxyH2 = "goproxy-h2"
)

// comparison is what a comparison with the plain MITM runs.
type comparison struct {
	bin  string   // the onceproxy binary
	self string   // an onceload binary, which serves the plain MITM
	env  []string // onceproxy's extra environment
	n, c int      // measured requests and their concurrency
	// fill is how many more unique misses each contender gets before the
	// measured ones: enough fill onceproxy's cache as hours of traffic
	// would (the shipped 256 MiB holds about 100,000 pages of 2 KiB), so
	// that its misses are measured at steady state.
	fill     int
	bodySize int
	latency  time.Duration // the origins' delay before each response
	stderr   io.Writer
}

// runComparison starts an HTTPS origin and a plain http one, onceproxy
// (o.bin, with o.env) and the plain MITM (o.self) twice, as shipped and
// with goproxy's AllowHTTP2, and runs o.n unique-URL misses at
// concurrency o.c through them: https over HTTP/1.1 (onceproxy and
// goproxy) and HTTP/2 (all three), then plain http (onceproxy and goproxy).
func runComparison(ctx context.Context, o comparison) ([]comparisonRow, error) {
	origin, err := loadgen.StartOrigin(loadgen.OriginOptions{TLS: true, BodySize: o.bodySize, Latency: o.latency})
	if err != nil {
		return nil, err
	}
	defer origin.Close()
	plainOrigin, err := loadgen.StartOrigin(loadgen.OriginOptions{BodySize: o.bodySize, Latency: o.latency})
	if err != nil {
		return nil, err
	}
	defer plainOrigin.Close()
	dir, err := os.MkdirTemp("", "onceload-compare")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	once, err := startOnceproxy(ctx, o.bin, origin.CAFile(), dir, o.env)
	if err != nil {
		return nil, err
	}
	defer once.stop()
	plain, err := startPlainMITM(ctx, o.self, origin.CAFile(), dir, false, o.stderr)
	if err != nil {
		return nil, err
	}
	defer plain.stop()
	plainH2, err := startPlainMITM(ctx, o.self, origin.CAFile(), dir, true, o.stderr)
	if err != nil {
		return nil, err
	}
	defer plainH2.stop()
	contenderOf := func(name string, ch *child) contender {
		return contender{name: name, proxy: &url.URL{Scheme: "http", Host: ch.addr}, caFile: ch.ca, pid: ch.cmd.Process.Pid}
	}
	if o.fill > 0 {
		// Once per process: the rows share them, and a full cache stays
		// full.
		stamp := fmt.Sprint(time.Now().UnixNano())
		for _, ct := range []contender{contenderOf(nameOnceproxy, once), contenderOf(nameGoproxyH2, plainH2), contenderOf(nameGoproxy, plain)} {
			if _, err := sendMisses(ctx, ct, origin.URL(), stamp, "fill", o.fill, o.c, false); err != nil {
				return nil, err
			}
		}
	}
	rows := []comparisonRow{
		{base: []string{nameGoproxy}},
		{h2: true, base: []string{nameGoproxyH2, nameGoproxy}},
		{plain: true, base: []string{nameGoproxy}},
	}
	for i := range rows {
		r := &rows[i]
		cs := []contender{contenderOf(nameOnceproxy, once)}
		if r.h2 {
			cs = append(cs, contenderOf(nameGoproxyH2, plainH2))
		}
		cs = append(cs, contenderOf(nameGoproxy, plain))
		base, scheme := origin.URL(), "https"
		if r.plain {
			base, scheme = plainOrigin.URL(), "http"
		}
		if r.ms, err = missLoad(ctx, cs, base, o, r.h2); err != nil {
			return nil, err
		}
		proto := "HTTP/1.1"
		if r.h2 {
			proto = "HTTP/2"
		}
		r.title = fmt.Sprintf("unique %s misses, %s clients, c=%d, %d requests each in %d alternating rounds", scheme, proto, o.c, o.n, missRounds)
		if o.fill > 0 {
			r.title += fmt.Sprintf(", after %d more", o.fill)
		}
		if o.latency > 0 {
			r.title += fmt.Sprintf(", origin answering after %v", o.latency)
		}
	}
	if origin.Requests() == 0 || plainOrigin.Requests() == 0 {
		return nil, errors.New("an origin saw no request")
	}
	return rows, nil
}

// envList splits a comma-separated KEY=VALUE list (-onceproxy-env).
func envList(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}
