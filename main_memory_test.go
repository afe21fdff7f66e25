package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/loadgen"
	"github.com/seed-a3c387e8/onceproxy/internal/logbuf"
)

// longTests turns on the tests that take a minute of load each; .ci/run
// sets it.
const longTests = "LONG_TESTS"

// proc is the onceproxy binary running as a child process.
type proc struct {
	cmd              *exec.Cmd
	proxyAddr, admin string
	config           string         // the config file it was started with
	log              *logbuf.Buffer // its JSON log lines, shown if the test fails
}

// startBinary builds onceproxy once per test and runs it with env added to
// the test's environment; it is killed with the test.
func startBinary(t *testing.T, config string, env []string) *proc {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "onceproxy")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return runBinary(t, "onceproxy", bin, writeConfig(t, config), env)
}

// runBinary runs the built onceproxy bin with the config file cfgPath and
// env added to the test's environment, and returns once it says where it
// listens. Its log is kept in p.log and shown if the test fails; it is
// killed with the test.
func runBinary(t *testing.T, name, bin, cfgPath string, env []string) *proc {
	t.Helper()
	p := &proc{cmd: exec.Command(bin, "-config", cfgPath), config: cfgPath, log: &logbuf.Buffer{}}
	// JSON logs: the listen lines are read from them.
	p.cmd.Env = append(append(os.Environ(), env...), "ONCEPROXY_LOG_FORMAT=json")
	stderr, err := p.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		_ = p.cmd.Wait()
		if t.Failed() {
			t.Logf("%s log:\n%s", name, p.log)
		}
	})
	sc := bufio.NewScanner(stderr)
	for (p.proxyAddr == "" || p.admin == "") && sc.Scan() {
		line := sc.Text()
		fmt.Fprintln(p.log, line)
		switch {
		case strings.Contains(line, `"msg":"proxy listening"`):
			p.proxyAddr = jsonField(line, "addr")
		case strings.Contains(line, `"msg":"admin listening"`):
			p.admin = jsonField(line, "addr")
		case strings.Contains(line, `"msg":"Go memory limit"`):
			t.Logf("%s: %s", name, line)
		}
	}
	if p.proxyAddr == "" || p.admin == "" {
		t.Fatalf("%s: no listen lines in:\n%s", name, p.log)
	}
	go io.Copy(p.log, stderr)
	return p
}

// peakRSS is the child's high-water resident set size, in bytes.
func (p *proc) peakRSS(t *testing.T) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatal("no VmHWM in /proc status")
	return 0
}

// TestMemoryStaysInsideItsLimit: with dedup.memory.max_bytes 256 MiB and
// spool_memory_bytes 64 MiB, 200k requests over 100k distinct 4 KiB pages
// (400 MB of distinct bodies, so the cache churns at its bound) keep the
// process's peak RSS within 1.3x the configured bounds: the cache, the
// spools and the certificate cache, the sum the Go memory limit is set
// from. Before the Go memory limit, RSS peaked at 2.5x.
func TestMemoryStaysInsideItsLimit(t *testing.T) {
	if os.Getenv(longTests) == "" {
		t.Skipf("a minute of load: set %s=1 (CI does)", longTests)
	}
	origin, err := loadgen.StartOrigin(loadgen.OriginOptions{BodySize: 4 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer origin.Close()
	p := startBinary(t, "log: {level: info, access: false}\ndedup: {ttl: 10m, spool_memory_bytes: 64MiB, memory: {max_bytes: 256MiB}}\n", []string{
		"ONCEPROXY_PROXY_LISTEN=127.0.0.1:0", "ONCEPROXY_ADMIN_LISTEN=127.0.0.1:0", "ONCEPROXY_SOCKS5_LISTEN=",
		"ONCEPROXY_MITM_CA_DIR=" + filepath.Join(t.TempDir(), "certs"),
	})
	const keys, requests = 100_000, 200_000
	targets := make([]string, keys)
	for i := range targets {
		targets[i] = fmt.Sprintf("%s/page/%d", origin.URL(), i)
	}
	start := time.Now()
	res, err := loadgen.Run(context.Background(), loadgen.Options{
		Proxy:   &url.URL{Scheme: "http", Host: p.proxyAddr},
		Targets: targets, N: requests, C: 32, Timeout: 30 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Errors > 0 {
		t.Fatalf("%d of %d requests failed: %v", res.Errors, requests, res.ErrorSamples)
	}
	// The cache, the spools (4 KiB bodies never fill them, but the
	// garbage collector may use what they leave) and the certificate cache.
	bounds := int64(256<<20) + 64<<20 + 10000*4<<10
	rss := p.peakRSS(t)
	t.Logf("%d requests over %d keys in %s: peak RSS %d MiB, %.2fx the configured %d MiB; origin saw %d",
		requests, keys, time.Since(start).Round(time.Second), rss>>20, float64(rss)/float64(bounds), bounds>>20, origin.Requests())
	if float64(rss) > 1.3*float64(bounds) {
		t.Errorf("peak RSS %d MiB is over 1.3x the configured bounds (%d MiB)", rss>>20, bounds>>20)
	}
}
