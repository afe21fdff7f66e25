package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/seed-a3c387e8/onceproxy/internal/app"
	"github.com/seed-a3c387e8/onceproxy/internal/loadgen"
	"github.com/seed-a3c387e8/onceproxy/internal/pgtest"
	"github.com/seed-a3c387e8/onceproxy/internal/redistest"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// BenchmarkStores measures what a shared store costs one onceproxy
// instance. Each store under test gets instances of its own, wired as main
// wires them (app.Build, the shipped config.yaml), in front of the same
// loopback HTTPS origins; loadgen sends unique https URLs through the
// proxy (CONNECT, MITM, HTTP/1.1) with 32 workers:
//
//	miss       every request a new URL: a flight, an origin fetch, a store write
//	hit        the same URLs again once the memory copy no longer answers
//	           alone (local_ttl 1ms): a hit that asks the store
//	coalesced  each URL 8 times at once, from an origin that takes 20 ms;
//	           with a shared store over two instances, so that the
//	           waiters of one wait on the other's flight
//
// Reported per request: req/s; cpu-µs, this process's CPU (the instances,
// the load generator and the origins all run in it, so compare stores, not
// absolute figures); goroutines, those this process started (the origin's
// one per request to hear its client leave included); store-cpu-µs, the
// store server's own (Redis: INFO's used_cpu_*); store-cmds and store-rtt,
// the store's own counters (Redis: INFO's commands processed, and its read
// events as the round trips: one per command or pipeline received,
// background work such as the heartbeat and the statistics included; PostgreSQL:
// pg_stat_statements' calls, every statement of a batch counted, background
// work included, and no round trips); origin, the requests that reached the
// origin.
//
// ONCELOAD_STORES (e.g. "memory,redis") picks the stores. The numbers are
// the machine's: run it alone on a quiet one, e.g.
//
//	go test -run '^$' -bench Stores -benchtime 20000x ./cmd/onceload/
func BenchmarkStores(b *testing.B) {
	fast := startBenchOrigin(b, 0)
	slow := startBenchOrigin(b, 20*time.Millisecond)
	for _, st := range storesUnderTest {
		if !picked(st.name) {
			continue
		}
		b.Run(st.name, func(b *testing.B) {
			env, counts := st.start(b)
			one := startBenchInstance(b, fast, slow, env)
			var two *benchInstance
			if st.shared {
				two = startBenchInstance(b, fast, slow, env)
			}
			b.Run("miss", func(b *testing.B) {
				targets := uniqueURLs(fast.URL(), b.N)
				measure(b, counts, fast, func() []*loadgen.Result {
					return []*loadgen.Result{one.run(b, targets, b.N, 1)}
				})
			})
			b.Run("hit", func(b *testing.B) {
				targets := uniqueURLs(fast.URL(), b.N)
				one.run(b, targets, b.N, 1)
				time.Sleep(10 * time.Millisecond) // past local_ttl
				measure(b, counts, fast, func() []*loadgen.Result {
					return []*loadgen.Result{one.run(b, targets, b.N, 1)}
				})
			})
			b.Run("coalesced", func(b *testing.B) {
				const copies = 8
				targets := uniqueURLs(slow.URL(), (b.N+copies-1)/copies)
				measure(b, counts, slow, func() []*loadgen.Result {
					if two == nil {
						return []*loadgen.Result{one.run(b, targets, b.N, copies)}
					}
					// Half the copies of each URL on each instance, at once.
					var res [2]*loadgen.Result
					var wg sync.WaitGroup
					for i, inst := range []*benchInstance{one, two} {
						wg.Go(func() { res[i] = inst.run(b, targets, (b.N+1-i)/2, copies/2) })
					}
					wg.Wait()
					return res[:]
				})
			})
		})
	}
}

// BenchmarkMissRatio measures what a shared store costs a unique miss as
// a ratio, which this machine's drifting speed disturbs far less than the
// req/s it is taken from: one instance per store (as in BenchmarkStores),
// then rounds in which each instance in turn serves its share of b.N
// unique https misses, so that every store sees the machine in the same
// state. Each round starts with a different instance, and each turn waits
// for the machine to go quiet first: a store's own work after its turn
// (PostgreSQL's background writers and vacuum, most of all) must not
// land in the next instance's time. Without that wait, memory-only ran
// right after PostgreSQL in every round and paid for it: redis/memory
// read 0.70–0.76 with PostgreSQL in the run and 0.59–0.68 without it.
// ONCELOAD_STORES (e.g. "memory,redis") picks the stores to compare.
// It reports each store's req/s over all rounds and its ratio to
// memory-only (redis/memory), and for a store that says what CPU it used
// the same ratio of CPU per miss, the store's own included
// (redis/memory-cpu: memory-only's CPU per miss over Redis's), and
// without it (redis/memory-instance-cpu: what the instance pays when its
// store runs on another machine, as in production):
//
//	go test -run '^$' -bench MissRatio -benchtime 60000x ./cmd/onceload/
func BenchmarkMissRatio(b *testing.B) {
	const rounds = 12
	fast := startBenchOrigin(b, 0)
	slow := startBenchOrigin(b, 20*time.Millisecond)
	type contender struct {
		name     string
		inst     *benchInstance
		counts   func() storeCounts
		n        int
		elapsed  time.Duration
		cpu      time.Duration // this process's, and the store's when storeCPU
		own      time.Duration // this process's alone
		storeCPU bool          // no store, or one that says what CPU it used
	}
	var all []*contender
	for _, st := range storesUnderTest {
		if !picked(st.name) {
			continue
		}
		env, counts := st.start(b)
		all = append(all, &contender{name: st.name, inst: startBenchInstance(b, fast, slow, env), counts: counts,
			storeCPU: counts == nil || counts().cpu >= 0})
	}
	if len(all) == 0 || all[0].counts != nil {
		b.Fatal("ONCELOAD_STORES must name memory, the base of the ratios")
	}
	per := max(b.N/(rounds*len(all)), 1)
	b.ResetTimer()
	for round := range rounds {
		for i := range all {
			c := all[(round+i)%len(all)]
			quiet(b)
			targets := uniqueURLs(fast.URL(), per)
			withStore := c.counts != nil && c.storeCPU
			var before storeCounts
			if withStore {
				before = c.counts()
			}
			start, cpu := time.Now(), processCPU()
			c.inst.run(b, targets, per, 1)
			c.elapsed += time.Since(start)
			own := processCPU() - cpu
			c.cpu += own
			c.own += own
			if withStore {
				c.cpu += c.counts().cpu - before.cpu
			}
			c.n += per
		}
	}
	b.StopTimer()
	base := all[0]
	rateOf := func(c *contender) float64 { return float64(c.n) / c.elapsed.Seconds() }
	cpuOf := func(c *contender) float64 { return c.cpu.Seconds() / float64(c.n) }
	ownOf := func(c *contender) float64 { return c.own.Seconds() / float64(c.n) }
	for _, c := range all {
		b.ReportMetric(rateOf(c), c.name+"-req/s")
		if c == base {
			continue
		}
		b.ReportMetric(rateOf(c)/rateOf(base), c.name+"/"+base.name)
		if c.storeCPU {
			b.ReportMetric(cpuOf(base)/cpuOf(c), c.name+"/"+base.name+"-cpu")
		}
		if c.counts != nil {
			b.ReportMetric(ownOf(base)/ownOf(c), c.name+"/"+base.name+"-instance-cpu")
		}
	}
}

// picked reports whether ONCELOAD_STORES, when set, names store.
func picked(store string) bool {
	list := os.Getenv("ONCELOAD_STORES")
	return list == "" || slices.Contains(strings.Split(list, ","), store)
}

// quiet waits, for at most 3s, until the machine's CPUs have been nearly
// idle (under a tenth of one CPU busy) for 50ms, as /proc/stat counts
// them: what one store's server or instance still does after its turn
// then stays out of the next one's. Where /proc/stat cannot be read it
// does not wait.
func quiet(b *testing.B) {
	b.Helper()
	const window = 50 * time.Millisecond
	deadline := time.Now().Add(3 * time.Second)
	busy, total, ok := cpuTicks()
	for ok && time.Now().Before(deadline) {
		time.Sleep(window)
		b2, t2, ok2 := cpuTicks()
		if !ok2 || t2 == total {
			return
		}
		// Ticks are summed over every CPU: busy/total is the fraction
		// of the whole machine, times the CPUs for one CPU's worth.
		if float64(b2-busy)/float64(t2-total)*float64(runtime.NumCPU()) < 0.1 {
			return
		}
		busy, total = b2, t2
	}
}

// cpuTicks returns /proc/stat's busy and total ticks over all CPUs.
func cpuTicks() (busy, total int64, ok bool) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, false
	}
	line, _, _ := strings.Cut(string(data), "\n")
	fields := strings.Fields(line)
	if len(fields) < 5 || fields[0] != "cpu" {
		return 0, 0, false
	}
	for i, f := range fields[1:] {
		v, err := strconv.ParseInt(f, 10, 64)
		if err != nil {
			return 0, 0, false
		}
		total += v
		if i != 3 && i != 4 { // idle, iowait
			busy += v
		}
	}
	return busy, total, true
}

// storeUnderTest is one way for the instances of a fleet to share their
// cache and flights.
type storeUnderTest struct {
	name string
	// start readies the store for b and returns the environment that
	// points an instance at it, and a reader of the store's own counters
	// (nil: no store). It skips b when the store cannot run here.
	start func(b *testing.B) (env []string, counts func() storeCounts)
	// shared: instances share it (the coalesced run uses two).
	shared bool
}

// storeCounts are a store's own counters of the work done for its clients;
// trips is negative for a store that does not count round trips, cpu for
// one that does not say what CPU it used.
type storeCounts struct {
	commands, trips int64
	cpu             time.Duration
}

var storesUnderTest = []storeUnderTest{
	{name: "memory", start: func(*testing.B) ([]string, func() storeCounts) { return nil, nil }},
	{name: "redis", shared: true, start: startRedisStore},
	{name: "postgres", shared: true, start: startPostgresStore},
}

// startRedisStore runs a private redis-server. local_ttl is 1ms so that a
// hit asks Redis: the cost of a hit whose memory copy has aged out.
func startRedisStore(b *testing.B) ([]string, func() storeCounts) {
	srv := redistest.Start(b)
	counts := func() storeCounts {
		st := srv.Stats()
		return storeCounts{commands: st.Commands, trips: st.Reads, cpu: st.CPU}
	}
	return []string{"ONCEPROXY_REDIS_URL=" + srv.URL, "ONCEPROXY_REDIS_LOCAL_TTL=1ms"}, counts
}

// startPostgresStore runs a private PostgreSQL cluster with
// pg_stat_statements, whose calls count the statements. PostgreSQL has no
// counter of round trips (a pipelined batch is several statements in one),
// so store-rtt is not reported for it; pgstore's TestStatementsPerRequest
// counts them with a client-side tracer. local_ttl is 1ms so that a hit
// asks the database.
func startPostgresStore(b *testing.B) ([]string, func() storeCounts) {
	srv := pgtest.Start(b, "shared_preload_libraries=pg_stat_statements", "pg_stat_statements.max=10000")
	srv.Exec("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
	var reads int64 // this function's own queries, which the view counts too
	counts := func() storeCounts {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, srv.URL)
		if err != nil {
			b.Fatalf("postgres: %v", err)
		}
		defer c.Close(ctx)
		var n int64
		if err := c.QueryRow(ctx, "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements").Scan(&n); err != nil {
			b.Fatalf("pg_stat_statements: %v", err)
		}
		reads++
		return storeCounts{commands: n - (reads - 1), trips: -1, cpu: -1}
	}
	return []string{"ONCEPROXY_POSTGRES_URL=" + srv.URL, "ONCEPROXY_POSTGRES_LOCAL_TTL=1ms"}, counts
}

func startBenchOrigin(b *testing.B, latency time.Duration) *loadgen.Origin {
	o, err := loadgen.StartOrigin(loadgen.OriginOptions{TLS: true, Latency: latency, BodySize: 2048})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(o.Close)
	return o
}

// benchInstance is one onceproxy running in this process.
type benchInstance struct {
	proxy  *url.URL
	caFile string // its MITM CA
}

func startBenchInstance(b *testing.B, fast, slow *loadgen.Origin, env []string) *benchInstance {
	b.Helper()
	shipped, err := os.ReadFile(filepath.Join("..", "..", "config.yaml"))
	if err != nil {
		b.Fatal(err)
	}
	dir := b.TempDir()
	environ := append([]string{
		"ONCEPROXY_PROXY_LISTEN=127.0.0.1:0",
		"ONCEPROXY_SOCKS5_LISTEN=",
		"ONCEPROXY_ADMIN_LISTEN=",
		"ONCEPROXY_MITM_CA_DIR=" + filepath.Join(dir, "certs"),
		"ONCEPROXY_UPSTREAM_CA_FILES=[" + fast.CAFile() + ", " + slow.CAFile() + "]",
		"ONCEPROXY_LOG_ACCESS=false",
	}, env...)
	cfg, err := app.LoadConfig(shipped, "", environ)
	if err != nil {
		b.Fatal(err)
	}
	a, err := app.Build(cfg, app.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx) }()
	b.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			b.Errorf("instance: %v", err)
		}
	})
	ca := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(ca, a.CA.CertPEM(), 0o644); err != nil {
		b.Fatal(err)
	}
	return &benchInstance{proxy: &url.URL{Scheme: "http", Host: a.Addrs().Proxy}, caFile: ca}
}

// run sends n requests over targets, each repeat times in a row, through
// the instance, and fails b on any error.
func (i *benchInstance) run(b *testing.B, targets []string, n, repeat int) *loadgen.Result {
	res, err := loadgen.Run(context.Background(), loadgen.Options{
		Proxy: i.proxy, CAFile: i.caFile, Targets: targets, N: n, C: 32, Repeat: repeat, Timeout: 30 * time.Second,
	})
	if err != nil {
		b.Fatal(err)
	}
	if res.Errors > 0 || res.Status[200] != res.Requests {
		b.Fatalf("%d errors (%q), statuses %v", res.Errors, res.ErrorSamples, res.Status)
	}
	return res
}

// measure times load and reports per request what it cost.
func measure(b *testing.B, counts func() storeCounts, origin *loadgen.Origin, load func() []*loadgen.Result) {
	var before storeCounts
	if counts != nil {
		before = counts()
	}
	fetched := origin.Requests()
	cpu, started := processCPU(), testkit.GoroutinesStarted()
	b.ResetTimer()
	start := time.Now()
	results := load()
	elapsed := time.Since(start)
	b.StopTimer()
	cpu, started = processCPU()-cpu, testkit.GoroutinesStarted()-started
	n := 0
	xcache := map[string]int{}
	for _, r := range results {
		n += r.Requests
		for k, v := range r.XCache {
			xcache[k] += v
		}
	}
	per := func(v int64) float64 { return float64(v) / float64(n) }
	b.ReportMetric(float64(n)/elapsed.Seconds(), "req/s")
	b.ReportMetric(per(origin.Requests()-fetched), "origin/op")
	b.ReportMetric(per(cpu.Microseconds()), "cpu-µs/op")
	b.ReportMetric(per(int64(started)), "goroutines/op")
	if counts != nil {
		after := counts()
		b.ReportMetric(per(after.commands-before.commands), "store-cmds/op")
		if after.trips >= 0 {
			b.ReportMetric(per(after.trips-before.trips), "store-rtt/op")
		}
		if after.cpu >= 0 {
			b.ReportMetric(per((after.cpu - before.cpu).Microseconds()), "store-cpu-µs/op")
		}
	}
	b.Logf("%d requests, X-Cache %v", n, xcache)
}

// processCPU is the CPU time this process has used, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// uniqueURLs returns n URLs under base that no earlier call returned.
func uniqueURLs(base string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s/u/%d", base, urlSeq.Add(1))
	}
	return out
}

var urlSeq atomic.Int64

// BenchmarkVsPlainMITM runs onceproxy (built from this tree, shipped
// defaults: dedup, keys, metrics, the access log and fingerprint mirroring
// on) and a plain goproxy MITM (loadgen.PlainMITM), each a process of its
// own, against the same loopback HTTPS origin: b.N unique https URLs
// through each at c=32, over HTTP/1.1 and HTTP/2 clients, in alternating
// rounds, then b.N unique plain http URLs (http-…). It reports req/s, CPU
// and minor page faults per request of each, and the ratios;
// HTTP/2 clients are compared with a goproxy that answers them over
// HTTP/2 (AllowHTTP2, the same protocol work: h2-…) and with goproxy as
// shipped, which answers them over HTTP/1.1 (h2-vs-h1-…). Run it alone on
// a quiet machine:
//
//	go test -run '^$' -bench VsPlainMITM -benchtime 40000x ./cmd/onceload/
//
// With ONCELOAD_FILL=120000 the proxies first get that many more unique
// misses, which fill onceproxy's cache: its steady state.
//
// onceload -compare runs the same comparison from the command line.
func BenchmarkVsPlainMITM(b *testing.B) {
	dir := b.TempDir()
	bin, self := filepath.Join(dir, "onceproxy"), filepath.Join(dir, "onceload")
	for _, build := range [][]string{{"-o", bin, "../.."}, {"-o", self, "."}} {
		if out, err := exec.Command("go", append([]string{"build"}, build...)...).CombinedOutput(); err != nil {
			b.Fatalf("go build %v: %v\n%s", build, err, out)
		}
	}
	b.ResetTimer()
	rows, err := runComparison(context.Background(), comparison{bin: bin, self: self, n: b.N, c: 32,
		fill: benchFill(b), bodySize: 2048, stderr: os.Stderr})
	if err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	for _, r := range rows {
		proto := "h1"
		switch {
		case r.h2:
			proto = "h2"
		case r.plain:
			proto = "http"
		}
		for _, m := range r.ms {
			b.ReportMetric(m.res.RPS, proto+"-"+m.name+"-req/s")
			b.ReportMetric(float64(m.cpuPerRequest().Microseconds()), proto+"-"+m.name+"-cpu-µs/req")
			b.ReportMetric(m.faultsPerRequest(), proto+"-"+m.name+"-faults/req")
		}
		for i, base := range r.base {
			prefix := proto
			if i > 0 {
				prefix += "-vs-" + base
			}
			rt := ratios(r.ms, nameOnceproxy, base)
			b.ReportMetric(rt.rps, prefix+"-req/s-ratio")
			b.ReportMetric(rt.cpu, prefix+"-cpu-ratio")
		}
	}
}

// benchFill is ONCELOAD_FILL, the unique misses BenchmarkVsPlainMITM sends
// before measuring (0 when unset).
func benchFill(b *testing.B) int {
	v := os.Getenv("ONCELOAD_FILL")
	if v == "" {
		return 0
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		b.Fatalf("ONCELOAD_FILL=%q: want a number of requests", v)
	}
	return n
}
