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
	cpu  time.Duration
}

// cpuPerRequest is the contender's CPU time per answered request.
func (m measured) cpuPerRequest() time.Duration {
	if m.res.Requests == 0 {
		return 0
	}
	return m.cpu / time.Duration(m.res.Requests)
}

// missLoad sends n requests, every URL new (a miss for a cache), at
// concurrency c through each contender in turn: first n/10 to warm up
// (connections, certificates), then n measured.
func missLoad(ctx context.Context, cs []contender, base string, n, c int, h2 bool) ([]measured, error) {
	var out []measured
	for _, ct := range cs {
		send := func(round string, n int) (*loadgen.Result, error) {
			targets := make([]string, n)
			for i := range targets {
				targets[i] = fmt.Sprintf("%s/u/%s/%s/%d", base, ct.name, round, i)
			}
			res, err := loadgen.Run(ctx, loadgen.Options{Proxy: ct.proxy, CAFile: ct.caFile, Targets: targets, N: n, C: c, HTTP2: h2, Timeout: 30 * time.Second})
			if err != nil {
				return nil, err
			}
			if bad := failed(res); bad > 0 {
				return nil, fmt.Errorf("%s: %d of %d requests failed (%q, statuses %v)", ct.name, bad, res.Requests, res.ErrorSamples, res.Status)
			}
			return res, nil
		}
		stamp := fmt.Sprint(time.Now().UnixNano())
		if _, err := send("warm"+stamp, max(n/10, c)); err != nil {
			return nil, err
		}
		before, err := loadgen.ProcessCPU(ct.pid)
		if err != nil {
			return nil, err
		}
		res, err := send(stamp, n)
		if err != nil {
			return nil, err
		}
		after, err := loadgen.ProcessCPU(ct.pid)
		if err != nil {
			return nil, err
		}
		out = append(out, measured{name: ct.name, res: res, cpu: after - before})
	}
	return out, nil
}

// printComparison writes ms as a table, each row against the last
// contender (the baseline).
func printComparison(w io.Writer, title string, ms []measured) {
	fmt.Fprintf(w, "%s\n", title)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "proxy\tclient spoke\treq/s\tCPU/req\tp50\tp99\tvs baseline req/s\tvs baseline CPU/req\t")
	base := ms[len(ms)-1]
	for _, m := range ms {
		fmt.Fprintf(tw, "%s\t%s\t%.0f\t%s\t%s\t%s\t%.2fx\t%.2fx\t\n", m.name, protos(m.res.Protos), m.res.RPS, m.cpuPerRequest().Round(time.Microsecond),
			m.res.P50.Round(10*time.Microsecond), m.res.P99.Round(10*time.Microsecond),
			m.res.RPS/base.res.RPS, float64(m.cpuPerRequest())/float64(base.cpuPerRequest()))
	}
	tw.Flush()
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
// binary) on a free port, trusting originCA.
func startPlainMITM(ctx context.Context, self, originCA, dir string, stderr io.Writer) (*child, error) {
	addr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	ca := filepath.Join(dir, "plain-ca.pem")
	cmd := exec.CommandContext(ctx, self, "-serve-plain-mitm", "-plain-addr", addr, "-plain-origin-ca", originCA, "-plain-ca-out", ca)
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
	p, err := loadgen.StartPlainMITM(loadgen.PlainMITMOptions{Addr: cfg.plainAddr, OriginCAFiles: cas})
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
// by -onceproxy) against a plain goproxy MITM, on unique https URLs, over
// HTTP/1.1 and HTTP/2.
func compareWithPlainMITM(ctx context.Context, cfg *config, stdout, stderr io.Writer) int {
	self, code := comparisonBinaries(cfg, "-compare", stderr)
	if code != 0 {
		return code
	}
	rows, err := runComparison(ctx, cfg.onceproxyBin, self, cfg.n, cfg.c, cfg.origin.BodySize, envList(cfg.onceproxyEnv), stderr)
	if err != nil {
		fmt.Fprintf(stderr, "onceload: %v\n", err)
		return 1
	}
	for _, r := range rows {
		printComparison(stdout, r.title, r.ms)
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
	ms    []measured
}

// runComparison starts an HTTPS origin, onceproxy (bin, with env) and the
// plain MITM (self), and runs n unique-URL misses at concurrency c through
// both, over HTTP/1.1 and HTTP/2.
func runComparison(ctx context.Context, bin, self string, n, c, bodySize int, env []string, stderr io.Writer) ([]comparisonRow, error) {
	origin, err := loadgen.StartOrigin(loadgen.OriginOptions{TLS: true, BodySize: bodySize})
	if err != nil {
		return nil, err
	}
	defer origin.Close()
	dir, err := os.MkdirTemp("", "onceload-compare")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	once, err := startOnceproxy(ctx, bin, origin.CAFile(), dir, env)
	if err != nil {
		return nil, err
	}
	defer once.stop()
	plain, err := startPlainMITM(ctx, self, origin.CAFile(), dir, stderr)
	if err != nil {
		return nil, err
	}
	defer plain.stop()
	cs := []contender{
		{name: "onceproxy", proxy: &url.URL{Scheme: "http", Host: once.addr}, caFile: once.ca, pid: once.cmd.Process.Pid},
		{name: "goproxy", proxy: &url.URL{Scheme: "http", Host: plain.addr}, caFile: plain.ca, pid: plain.cmd.Process.Pid},
	}
	var rows []comparisonRow
	for _, h2 := range []bool{false, true} {
		proto := "HTTP/1.1"
		if h2 {
			proto = "HTTP/2"
		}
		ms, err := missLoad(ctx, cs, origin.URL(), n, c, h2)
		if err != nil {
			return nil, err
		}
		rows = append(rows, comparisonRow{title: fmt.Sprintf("unique https misses, %s clients, c=%d, %d requests each", proto, c, n), ms: ms})
	}
	if origin.Requests() == 0 {
		return nil, errors.New("the origin saw no request")
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
