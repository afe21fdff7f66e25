package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// proxyBin is the onceproxy binary TestMain builds; repoRoot is the module.
var proxyBin, repoRoot string

func TestMain(m *testing.M) {
	os.Exit(runTests(m))
}

func runTests(m *testing.M) int {
	var err error
	if repoRoot, err = filepath.Abs(".."); err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	dir, err := os.MkdirTemp("", "onceproxy-e2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	defer os.RemoveAll(dir)
	proxyBin = filepath.Join(dir, "onceproxy")
	args := []string{"build", "-o", proxyBin}
	if raceEnabled {
		// The program under test gets the race detector too; a race it
		// finds makes it exit 66, which stopProxy reports.
		args = append(args, "-race")
	}
	cmd := exec.Command("go", append(args, ".")...)
	cmd.Dir = repoRoot
	if out, err := cmd.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: go build of onceproxy failed: %v\n%s", err, out)
		return 1
	}
	return m.Run()
}

// needClient returns the path of a client program, or ends the test: a
// failure under CI (a missing client must not pass silently), a skip on a
// developer's machine.
func needClient(t *testing.T, name, why string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		missing(t, fmt.Sprintf("%s not found on PATH (%s)", name, why))
	}
	return p
}

// missing ends a test whose client is not installed.
func missing(t *testing.T, msg string) {
	t.Helper()
	if os.Getenv("CI") != "" {
		t.Fatalf("client missing under CI: %s; .ci/run should install it", msg)
	}
	t.Skipf("skipped: %s (install it, or run .ci/run; under CI this fails)", msg)
}

// artifactsDir is where screenshots go: $E2E_ARTIFACTS or e2e/artifacts.
func artifactsDir(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("E2E_ARTIFACTS")
	if dir == "" {
		dir = filepath.Join(repoRoot, "e2e", "artifacts")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// logBuffer keeps a process's output lines for assertions and for the
// test log when a test fails.
type logBuffer struct {
	mu    sync.Mutex
	lines []string
}

func (b *logBuffer) add(line string) {
	b.mu.Lock()
	b.lines = append(b.lines, line)
	b.mu.Unlock()
}

func (b *logBuffer) all() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.lines...)
}

// proxyUser is the account the auth tests configure.
const (
	proxyUser     = "alice"
	proxyPassword = "e2e-s3cret"
)

// onceproxy is one running onceproxy process.
type onceproxy struct {
	ProxyAddr, SOCKSAddr, AdminAddr string
	CAFile                          string // certs/ca.pem, created at start
	SPKI                            string // base64 sha256 of the CA's SPKI
	cmd                             *exec.Cmd
	log                             *logBuffer
	done                            chan struct{}
	waitErr                         error
}

type proxyOpts struct {
	auth bool     // users: alice / proxyPassword (password_env)
	env  []string // more ONCEPROXY_ overrides
}

// startProxy runs the real program with the built-in defaults plus env
// overrides: loopback ports picked by the kernel, a fresh CA directory, the
// origin's CA trusted upstream, JSON logs (read for the bound addresses).
// Cleanup stops it with SIGTERM and checks it exits 0.
func startProxy(t *testing.T, originCA string, o proxyOpts) *onceproxy {
	t.Helper()
	dir := t.TempDir()
	env := []string{}
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "ONCEPROXY_") || strings.EqualFold(k, "http_proxy") ||
			strings.EqualFold(k, "https_proxy") || strings.EqualFold(k, "all_proxy") || k == "REDIS_URL" {
			continue
		}
		env = append(env, kv)
	}
	env = append(env,
		"ONCEPROXY_PROXY_LISTEN=127.0.0.1:0",
		"ONCEPROXY_SOCKS5_LISTEN=127.0.0.1:0",
		"ONCEPROXY_ADMIN_LISTEN=127.0.0.1:0",
		"ONCEPROXY_MITM_CA_DIR="+filepath.Join(dir, "certs"),
		"ONCEPROXY_UPSTREAM_CA_FILES=["+originCA+"]",
		"ONCEPROXY_LOG_FORMAT=json",
		"ONCEPROXY_PROXY_SHUTDOWN_GRACE=5s",
	)
	if o.auth {
		env = append(env,
			"ONCEPROXY_AUTH_USERS=[{name: "+proxyUser+", password_env: E2E_PW}]",
			"E2E_PW="+proxyPassword)
	}
	env = append(env, o.env...)

	p := &onceproxy{log: &logBuffer{}, done: make(chan struct{})}
	cmd := exec.Command(proxyBin)
	cmd.Dir = dir // no config.yaml here: the built-in defaults
	cmd.Env = env
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout = io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatalf("start onceproxy: %v", err)
	}
	p.cmd = cmd
	addrs := make(chan [2]string, 8)
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			p.log.add(line)
			var rec struct {
				Msg  string `json:"msg"`
				Addr string `json:"addr"`
			}
			if json.Unmarshal([]byte(line), &rec) == nil && strings.HasSuffix(rec.Msg, " listening") {
				select {
				case addrs <- [2]string{rec.Msg, rec.Addr}:
				default: // never block the reader: it drains the pipe
				}
			}
		}
		p.waitErr = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() { p.stop(t) })

	timeout := time.After(60 * time.Second)
	for p.ProxyAddr == "" || p.SOCKSAddr == "" || p.AdminAddr == "" {
		select {
		case a := <-addrs:
			switch a[0] {
			case "proxy listening":
				p.ProxyAddr = a[1]
			case "socks5 listening":
				p.SOCKSAddr = a[1]
			case "admin listening":
				p.AdminAddr = a[1]
			}
		case <-p.done:
			t.Fatalf("onceproxy exited during start-up: %v\n%s", p.waitErr, strings.Join(p.log.all(), "\n"))
		case <-timeout:
			t.Fatalf("onceproxy did not report its listeners in 60s\n%s", strings.Join(p.log.all(), "\n"))
		}
	}
	p.CAFile = filepath.Join(dir, "certs", "ca.pem")
	caPEM, err := os.ReadFile(p.CAFile)
	if err != nil {
		t.Fatalf("read the CA: %v", err)
	}
	p.SPKI = spkiOf(t, caPEM)
	// The CA the admin API serves is the one on disk.
	if got := p.adminGet(t, "/ca.pem"); !bytes.Equal(got, caPEM) {
		t.Fatalf("GET /ca.pem differs from %s", p.CAFile)
	}
	return p
}

// spkiOf is what Chromium's --ignore-certificate-errors-spki-list takes:
// base64(sha256(SubjectPublicKeyInfo)).
func spkiOf(t *testing.T, certPEM []byte) string {
	t.Helper()
	block, _ := pem.Decode(certPEM)
	if block == nil {
		t.Fatal("CA file holds no PEM block")
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(cert.RawSubjectPublicKeyInfo)
	return base64.StdEncoding.EncodeToString(sum[:])
}

// URL of the HTTP proxy, with credentials when user is not empty.
func (p *onceproxy) URL(user, password string) string {
	if user == "" {
		return "http://" + p.ProxyAddr
	}
	return "http://" + user + ":" + password + "@" + p.ProxyAddr
}

// stop sends SIGTERM and expects a clean exit 0 within the shutdown grace.
func (p *onceproxy) stop(t *testing.T) {
	select {
	case <-p.done:
	default:
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(30 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.done
			t.Errorf("onceproxy did not stop within 30s of SIGTERM; killed")
		}
	}
	if p.waitErr != nil {
		t.Errorf("onceproxy exited with %v (66 = the race detector found a race)", p.waitErr)
	}
	if t.Failed() {
		lines := p.log.all()
		if len(lines) > 200 {
			lines = lines[len(lines)-200:]
		}
		t.Logf("onceproxy log (last %d lines):\n%s", len(lines), strings.Join(lines, "\n"))
	}
}

var adminClient = &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{Proxy: nil}}

func (p *onceproxy) adminGet(t *testing.T, path string) []byte {
	t.Helper()
	resp, err := adminClient.Get("http://" + p.AdminAddr + path)
	if err != nil {
		t.Fatalf("admin GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("admin GET %s: %d %v\n%s", path, resp.StatusCode, err, body)
	}
	return body
}

// stats is the instance part of GET /cache/stats.
type stats struct {
	Requests         uint64            `json:"requests"`
	XCache           map[string]uint64 `json:"x_cache"`
	UpstreamRequests uint64            `json:"upstream_requests"`
	RequestsAvoided  uint64            `json:"upstream_requests_avoided"`
	SavingsPct       float64           `json:"savings_pct"`
	Flights          int64             `json:"flights_in_progress"`
	Waiters          int64             `json:"flight_waiters"`
}

func (p *onceproxy) stats(t *testing.T) stats {
	t.Helper()
	var body struct {
		Instance stats `json:"instance"`
	}
	if err := json.Unmarshal(p.adminGet(t, "/cache/stats"), &body); err != nil {
		t.Fatalf("decode /cache/stats: %v", err)
	}
	return body.Instance
}

// accessLog returns the proxy's access-log records ("request" lines).
func (p *onceproxy) accessLog() []map[string]any {
	var out []map[string]any
	for _, line := range p.log.all() {
		var rec map[string]any
		if json.Unmarshal([]byte(line), &rec) == nil && rec["msg"] == "request" {
			out = append(out, rec)
		}
	}
	return out
}

// assertLoopbackOnly checks the proxy was asked for loopback targets only:
// no client (a browser's background traffic above all) made it reach out.
func (p *onceproxy) assertLoopbackOnly(t *testing.T) {
	t.Helper()
	for _, line := range p.log.all() {
		var rec map[string]any
		if json.Unmarshal([]byte(line), &rec) != nil {
			continue
		}
		var target string
		switch rec["msg"] {
		case "request":
			target, _ = rec["host"].(string)
		case "tunnel", "refused CONNECT", "refused CONNECT to a forbidden target":
			target, _ = rec["target"].(string)
		default:
			continue
		}
		host := target
		if h, _, err := net.SplitHostPort(target); err == nil {
			host = h
		}
		if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
			t.Errorf("the proxy was asked for a non-loopback target %q: %s", target, line)
		}
	}
}

// runCmd runs a client with a deadline and returns its stdout; stderr goes
// to the test log when it fails. The process is killed when ctx ends.
func runCmd(t *testing.T, ctx context.Context, stdin []byte, env []string, name string, args ...string) ([]byte, error) {
	t.Helper()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = env
	cmd.WaitDelay = 5 * time.Second
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	// Its own process group: children (Chromium's renderers, zygote) go
	// with it. On the deadline the group gets SIGTERM first, so that
	// Playwright and Puppeteer close the browsers they started in groups
	// of their own; WaitDelay later the client is killed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM) }
	err := cmd.Run()
	if cmd.Process != nil {
		// Whatever it left behind in its group goes too.
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) || ctx.Err() != nil {
			err = fmt.Errorf("%s: %w (ctx: %v)\nstderr:\n%s", filepath.Base(name), err, ctx.Err(), tail(stderr.String(), 4000))
		}
		return stdout.Bytes(), err
	}
	return stdout.Bytes(), nil
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "…" + s[len(s)-n:]
}

// cleanEnv is the test's environment without any proxy variables, plus kv.
func cleanEnv(kv ...string) []string {
	var env []string
	for _, e := range os.Environ() {
		k, _, _ := strings.Cut(e, "=")
		switch strings.ToLower(k) {
		case "http_proxy", "https_proxy", "all_proxy", "no_proxy", "requests_ca_bundle", "curl_ca_bundle", "ssl_cert_file":
			continue
		}
		env = append(env, e)
	}
	return append(env, kv...)
}
