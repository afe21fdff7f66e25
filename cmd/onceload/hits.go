package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"text/tabwriter"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/loadgen"
)

// hitRounds is how many times a hit comparison alternates between going
// direct and going through the proxy: on a shared machine the speed drifts
// over seconds, and alternating rounds give both sides the same drift.
const hitRounds = 5

// hitRow is one scheme's hit comparison.
type hitRow struct {
	scheme          string
	direct, proxied time.Duration // summed over the rounds
	requests        int           // per side
	hits            int           // proxied answers with X-Cache: HIT
	// Latency of the last round: median and 99th percentile.
	directP50, viaP50, directP99, viaP99 time.Duration
}

// compareHits is onceload -compare-hits: the same requests over -k hot
// keys at -c, sent directly to a loopback origin and through onceproxy
// (the binary given by -onceproxy, shipped defaults), over https and plain
// http, in alternating rounds. It reports both sides' req/s and their
// ratio (what answering from the cache costs against the origin itself),
// the share of HITs, and the last round's p50 and p99 on each side.
func compareHits(ctx context.Context, cfg *config, stdout, stderr io.Writer) int {
	self, code := comparisonBinaries(cfg, "-compare-hits", stderr)
	if code != 0 {
		return code
	}
	rows, err := runHitComparison(ctx, cfg.onceproxyBin, self, cfg.n, cfg.c, cfg.k, cfg.origin.BodySize, envList(cfg.onceproxyEnv))
	if err != nil {
		fmt.Fprintf(stderr, "onceload: %v\n", err)
		return 1
	}
	fmt.Fprintf(stdout, "hits against direct: %d hot keys, c=%d, %d requests each side in %d alternating rounds\n", cfg.k, cfg.c, rows[0].requests, hitRounds)
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "scheme\tdirect req/s\tonceproxy req/s\tratio\tHIT share\tp50 direct\tp50 onceproxy\tp99 direct\tp99 onceproxy\t")
	for _, r := range rows {
		d, p := float64(r.requests)/r.direct.Seconds(), float64(r.requests)/r.proxied.Seconds()
		fmt.Fprintf(tw, "%s\t%.0f\t%.0f\t%.2fx\t%.1f%%\t%s\t%s\t%s\t%s\t\n", r.scheme, d, p, p/d,
			100*float64(r.hits)/float64(r.requests), r.directP50.Round(10*time.Microsecond), r.viaP50.Round(10*time.Microsecond),
			r.directP99.Round(10*time.Microsecond), r.viaP99.Round(10*time.Microsecond))
	}
	tw.Flush()
	return 0
}

// runHitComparison starts, per scheme, an origin (self -serve-origin, a
// process of its own as a real origin is: sharing this process's runtime
// would make going direct look cheaper than it is) and onceproxy (bin,
// with env) trusting it; it warms the proxy's cache with every key, then
// sends n requests each way over k keys at concurrency c.
func runHitComparison(ctx context.Context, bin, self string, n, c, k, bodySize int, env []string) ([]hitRow, error) {
	dir, err := os.MkdirTemp("", "onceload-hits")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	var rows []hitRow
	for _, scheme := range []string{"https", "http"} {
		row, err := func() (hitRow, error) {
			origin, err := startOriginProcess(ctx, self, scheme == "https", bodySize, filepath.Join(dir, "origin-"+scheme))
			if err != nil {
				return hitRow{}, err
			}
			defer origin.stop()
			once, err := startOnceproxy(ctx, bin, origin.ca, dir, env)
			if err != nil {
				return hitRow{}, err
			}
			defer once.stop()
			return hitLoad(ctx, scheme, origin.addr, origin.ca, &url.URL{Scheme: "http", Host: once.addr}, once.ca, n, c, k)
		}()
		if err != nil {
			return nil, err
		}
		rows = append(rows, row)
	}
	return rows, nil
}

// startOriginProcess runs `self -serve-origin` (no latency) on a free port;
// with tls, ca is the certificate file it serves under, written to dir.
func startOriginProcess(ctx context.Context, self string, tls bool, bodySize int, dir string) (*child, error) {
	addr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, self, "-serve-origin", "-origin-latency", "0", "-origin-addr", addr,
		"-origin-size", fmt.Sprint(bodySize), fmt.Sprint("-origin-tls=", tls), "-origin-cert-dir", dir)
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	ca := ""
	if tls {
		ca = filepath.Join(dir, "origin.pem")
	}
	return startChild(ctx, "origin", cmd, addr, ca, ca)
}

// hitLoad runs one scheme's alternating rounds against the origin at
// addr (trusted through originCA for https).
func hitLoad(ctx context.Context, scheme, addr, originCA string, proxy *url.URL, proxyCA string, n, c, k int) (hitRow, error) {
	targets := make([]string, k)
	for i := range targets {
		targets[i] = fmt.Sprintf("%s://%s/hot/%d", scheme, addr, i)
	}
	row := hitRow{scheme: scheme}
	send := func(via bool, n int) (*loadgen.Result, error) {
		opts := loadgen.Options{CAFile: originCA, Targets: targets, N: n, C: c, Timeout: 30 * time.Second}
		if via {
			opts.Proxy, opts.CAFile = proxy, proxyCA
		}
		return runChecked(ctx, row.scheme, opts)
	}
	// Warm both sides: connections, certificates, and every key cached.
	for _, via := range []bool{false, true} {
		if _, err := send(via, max(2*k, c)); err != nil {
			return row, err
		}
	}
	per := max(n/hitRounds, c)
	for range hitRounds {
		d, err := send(false, per)
		if err != nil {
			return row, err
		}
		p, err := send(true, per)
		if err != nil {
			return row, err
		}
		row.direct += d.Duration
		row.proxied += p.Duration
		row.requests += per
		row.hits += p.XCache["HIT"]
		row.directP50, row.viaP50, row.directP99, row.viaP99 = d.P50, p.P50, d.P99, p.P99
	}
	if row.hits == 0 {
		return row, errors.New("no answer through the proxy was a HIT")
	}
	return row, nil
}
