package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/logbuf"
	"github.com/seed-a3c387e8/onceproxy/internal/redistest"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// testEnv returns a configuration, as environment overrides, that runs
// everything on free loopback ports with the CA in a temp dir and trusts the
// httptest origin certificate.
func testEnv(t *testing.T, origin *httptest.Server) []string {
	t.Helper()
	dir := t.TempDir()
	caFile := filepath.Join(dir, "origin.pem")
	pemBytes := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: origin.Certificate().Raw})
	if err := os.WriteFile(caFile, pemBytes, 0o644); err != nil {
		t.Fatal(err)
	}
	return []string{
		"ONCEPROXY_PROXY_LISTEN=127.0.0.1:0",
		"ONCEPROXY_ADMIN_LISTEN=127.0.0.1:0",
		"ONCEPROXY_SOCKS5_LISTEN=127.0.0.1:0",
		"ONCEPROXY_MITM_CA_DIR=" + filepath.Join(dir, "certs"),
		"ONCEPROXY_UPSTREAM_CA_FILES=[" + caFile + "]",
		"ONCEPROXY_PROXY_SHUTDOWN_GRACE=10s",
	}
}

func proxyClient(t *testing.T, proxyAddr string, caPEM []byte) *http.Client {
	t.Helper()
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		t.Fatal("CA PEM from the admin API does not parse")
	}
	tr := &http.Transport{
		Proxy:           http.ProxyURL(&url.URL{Scheme: "http", Host: proxyAddr}),
		TLSClientConfig: &tls.Config{RootCAs: pool},
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

// TestRun wires the whole program in-process: admin API, CA download, a
// request through the MITM, and a clean stop when the context ends.
func TestRun(t *testing.T) {
	origin := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "hello from origin")
	}))
	defer origin.Close()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	type addrs struct{ proxy, admin string }
	readyc := make(chan addrs, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"-config", writeConfig(t, "log: {level: warn}\n")}, testEnv(t, origin), io.Discard,
			func(p, a string) { readyc <- addrs{p, a} })
	}()
	var a addrs
	select {
	case a = <-readyc:
	case err := <-done:
		t.Fatalf("run: %v", err)
	}

	resp, err := http.Get("http://" + a.admin + "/health")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("/health: %v %v", err, resp)
	}
	resp.Body.Close()
	resp, err = http.Get("http://" + a.admin + "/ca.pem")
	if err != nil {
		t.Fatal(err)
	}
	caPEM, _ := io.ReadAll(resp.Body)
	resp.Body.Close()

	c := proxyClient(t, a.proxy, caPEM)
	resp, err = c.Get(origin.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "hello from origin" {
		t.Fatalf("body %q", body)
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run returned %v after cancel", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("run did not return after cancel")
	}
}

func TestRunRejectsBadConfig(t *testing.T) {
	err := run(context.Background(), []string{"-config", writeConfig(t, "proxy: {listen: nope}\n")}, nil, io.Discard, nil)
	if err == nil || !strings.Contains(err.Error(), "proxy.listen") {
		t.Fatalf("err = %v", err)
	}
	err = run(context.Background(), []string{"-config", "/nonexistent/config.yaml"}, nil, io.Discard, nil)
	if err == nil || !strings.Contains(err.Error(), "no such file") {
		t.Fatalf("missing explicit config: err = %v", err)
	}
}

// running is the real binary serving (startBinary), with a client
// through its proxy.
type running struct {
	*proc
	client *http.Client
}

// startServing runs onceproxy (startBinary) in front of origin, with a
// client that trusts its CA.
func startServing(t *testing.T, origin *httptest.Server) *running {
	t.Helper()
	if testing.Short() {
		t.Skip("builds the binary")
	}
	p := startBinary(t, "", testEnv(t, origin))
	resp, err := http.Get("http://" + p.admin + "/ca.pem")
	if err != nil {
		t.Fatal(err)
	}
	caPEM, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return &running{proc: p, client: proxyClient(t, p.proxyAddr, caPEM)}
}

// get fetches url through the proxy in the background: "status body", or
// "error: ...".
func (r *running) get(url string) <-chan string {
	result := make(chan string, 1)
	go func() {
		resp, err := r.client.Get(url)
		if err != nil {
			result <- "error: " + err.Error()
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		result <- fmt.Sprintf("%d %s", resp.StatusCode, b)
	}()
	return result
}

// exited waits up to d for the process to end and returns how it did.
func (r *running) exited(t *testing.T, d time.Duration) error {
	t.Helper()
	waitErr := make(chan error, 1)
	go func() { waitErr <- r.cmd.Wait() }()
	select {
	case err := <-waitErr:
		return err
	case <-time.After(d):
		t.Fatalf("process still running %v after the signal", d)
		return nil
	}
}

// TestSIGTERMDrainsInFlight runs the real binary, sends SIGTERM while a
// request is in flight through the MITM, and expects the request to finish
// and the process to exit 0.
func TestSIGTERMDrainsInFlight(t *testing.T) {
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	origin := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		<-release
		io.WriteString(w, "drained")
	}))
	defer origin.Close()
	r := startServing(t, origin)
	result := r.get(origin.URL + "/slow")
	<-started
	if err := r.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// Give the signal a moment to be delivered before the origin answers;
	// the request must survive the shutdown either way.
	time.Sleep(200 * time.Millisecond)
	close(release)
	if got := <-result; got != "200 drained" {
		t.Fatalf("in-flight request during SIGTERM: %s", got)
	}
	if err := r.exited(t, 15*time.Second); err != nil {
		t.Fatalf("process exit: %v", err)
	}
}

// TestSecondSignalEndsAtOnce: a second SIGTERM (or Ctrl-C) during the
// drain ends the process at once, as an operator who sends it means. The
// first one's graceful shutdown held it for the whole
// proxy.shutdown_grace (20 s) whatever followed.
func TestSecondSignalEndsAtOnce(t *testing.T) {
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	origin := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/stuck" {
			return // the probes for the port's close answer at once
		}
		started <- struct{}{}
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer origin.Close()
	defer close(release)
	r := startServing(t, origin)
	result := r.get(origin.URL + "/stuck")
	<-started
	if err := r.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// The drain has begun once the port refuses new clients.
	testkit.Eventually(t, testkit.Patience, func() bool {
		return strings.HasPrefix(<-r.get(origin.URL+"/new"), "error:")
	}, "the proxy port to close")
	if err := r.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	err := r.exited(t, 5*time.Second)
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		t.Fatalf("process exit after the second signal: %v, want it killed by the signal", err)
	}
	if got := <-result; !strings.HasPrefix(got, "error:") {
		t.Logf("in-flight request: %s", got)
	}
}

// TestGraceCutExitsZero: a drain that proxy.shutdown_grace cuts short is
// still the orderly stop the operator (systemd, Kubernetes) asked for: the
// process exits 0 and a warning says how many requests were cut. It exited
// 1, which marked the unit failed and fired restart policies and alerts on
// every rollout that caught a slow request.
func TestGraceCutExitsZero(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	origin := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer origin.Close()
	defer close(release)
	p := startBinary(t, "", append(testEnv(t, origin), "ONCEPROXY_PROXY_SHUTDOWN_GRACE=500ms"))
	resp, err := http.Get("http://" + p.admin + "/ca.pem")
	if err != nil {
		t.Fatal(err)
	}
	caPEM, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	r := &running{proc: p, client: proxyClient(t, p.proxyAddr, caPEM)}
	result := r.get(origin.URL + "/stuck")
	<-started
	if err := r.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// The log is read up to its last line before the exit status: Wait
	// closes the pipe it is copied from.
	testkit.Eventually(t, testkit.Patience, func() bool {
		return strings.Contains(r.log.String(), `"msg":"stopped"`)
	}, "the last log line")
	if err := r.exited(t, 15*time.Second); err != nil {
		t.Fatalf("process exit after a drain cut by shutdown_grace: %v, want status 0", err)
	}
	warned := false
	for _, l := range strings.Split(r.log.String(), "\n") {
		if strings.Contains(l, `"msg":"shutdown: proxy.shutdown_grace ran out; requests still in flight were cut"`) {
			warned = true
			if !strings.Contains(l, `"level":"WARN"`) || jsonNumber(l, "requests") != "1" {
				t.Errorf("the line does not warn of the one request cut: %s", l)
			}
		}
	}
	if !warned {
		t.Error("no warning says requests were cut")
	}
	if got := <-result; !strings.HasPrefix(got, "error:") {
		t.Logf("in-flight request: %s", got)
	}
}

// jsonNumber pulls "key":number out of a JSON log line.
func jsonNumber(line, key string) string {
	_, rest, ok := strings.Cut(line, `"`+key+`":`)
	if !ok {
		return ""
	}
	end := strings.IndexAny(rest, ",}")
	if end < 0 {
		return ""
	}
	return rest[:end]
}

// jsonField pulls "key":"value" out of a JSON log line.
func jsonField(line, key string) string {
	_, rest, ok := strings.Cut(line, `"`+key+`":"`)
	if !ok {
		return ""
	}
	v, _, _ := strings.Cut(rest, `"`)
	return v
}

// TestFleetOfThree runs three complete onceproxy programs sharing one
// redis-server: 300 concurrent identical requests spread over their proxy
// ports reach a 200 ms origin once, and /cache/stats reports the fleet.
func TestFleetOfThree(t *testing.T) {
	const perInstance, instances = 100, 3
	const n = perInstance * instances
	rs := redistest.Start(t)
	certs := filepath.Join(t.TempDir(), "certs")

	var admins []string
	var hits atomic.Int64
	origin := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		time.Sleep(200 * time.Millisecond)
		// Answer once every client is waiting somewhere in the fleet.
		var last int64
		var lastErr error
		if !testkit.Wait(t, testkit.Patience, func() bool {
			last, lastErr = waiting(admins)
			return last == n
		}, "%d clients waiting in the fleet", n) {
			t.Errorf("fleet waiters: %d (last error %v)", last, lastErr)
		}
		fmt.Fprintf(w, "fleet answer %d", time.Now().UnixNano())
	}))
	defer origin.Close()

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	var proxies []string
	logs := &logbuf.Buffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("instance logs:\n%s", logs)
		}
	})
	for i := range instances {
		env := append(testEnv(t, origin), "ONCEPROXY_REDIS_URL="+rs.URL, "ONCEPROXY_MITM_CA_DIR="+certs, "ONCEPROXY_LOG_ACCESS=false",
			// 300 TLS handshakes on two cores under -race can delay a
			// Redis dial or reply past the production 200/250ms, which would
			// (correctly) trip the breaker and let instances fetch alone,
			// and a client's first request in its tunnel past the header
			// timeout (which would, correctly, close the connection).
			"ONCEPROXY_REDIS_TIMEOUT=3s", "ONCEPROXY_REDIS_DIAL_TIMEOUT=3s", "ONCEPROXY_REDIS_LEASE=15s",
			"ONCEPROXY_PROXY_READ_HEADER_TIMEOUT=60s")
		ready := make(chan [2]string, 1)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := run(ctx, []string{"-config", writeConfig(t, "log: {level: warn}\n")}, env, logs,
				func(p, a string) { ready <- [2]string{p, a} }); err != nil {
				t.Errorf("instance %d: %v", i, err)
			}
		}()
		addrs := <-ready
		proxies = append(proxies, addrs[0])
		admins = append(admins, addrs[1])
	}
	caPEM, err := os.ReadFile(filepath.Join(certs, "ca.pem"))
	if err != nil {
		t.Fatal(err)
	}
	results := make(chan string, n)
	for i := range n {
		c := proxyClient(t, proxies[i%instances], caPEM)
		c.Timeout = time.Minute // 300 TLS handshakes are slow under -race
		go func() {
			resp, err := c.Get(origin.URL + "/fleet")
			if err != nil {
				results <- "error: " + err.Error()
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			results <- fmt.Sprintf("%d %s", resp.StatusCode, b)
		}()
	}
	first := ""
	for range n {
		r := <-results
		if !strings.HasPrefix(r, "200 fleet answer") {
			t.Fatalf("client got %q", r)
		}
		if first == "" {
			first = r
		} else if r != first {
			t.Fatalf("different bodies: %q vs %q", r, first)
		}
	}
	if hits.Load() != 1 {
		t.Fatalf("origin saw %d requests, want 1", hits.Load())
	}
	// The fleet statistics (flushed every second) count every instance.
	var st struct {
		Fleet struct {
			Today struct {
				Requests int64 `json:"requests"`
			} `json:"today"`
		} `json:"fleet"`
	}
	var statsErr error
	if !testkit.Poll(testkit.Patience, func() bool {
		statsErr = testkit.GetJSON("http://"+admins[0]+"/cache/stats", &st)
		return statsErr == nil && st.Fleet.Today.Requests == n
	}) {
		t.Fatalf("fleet stats count %d requests, want %d (%v)", st.Fleet.Today.Requests, n, statsErr)
	}
}

// settled reports whether the instance behind admin has handed what its
// flights fetched to the fleet's store: a flight does that just after its
// clients have their answer, so a test that expects a HIT elsewhere next
// waits for this first.
func settled(admin string) bool {
	var st struct {
		Instance struct {
			Sharing *int64 `json:"flights_sharing"`
		} `json:"instance"`
	}
	return testkit.GetJSON("http://"+admin+"/cache/stats", &st) == nil && st.Instance.Sharing != nil && *st.Instance.Sharing == 0
}

// waiting sums flight_waiters over the instances' admin APIs. It runs in
// an origin handler: it reports errors rather than failing the test.
func waiting(admins []string) (int64, error) {
	var total int64
	for _, a := range admins {
		var st struct {
			Instance struct {
				Waiters int64 `json:"flight_waiters"`
			} `json:"instance"`
		}
		if err := testkit.GetJSON("http://"+a+"/cache/stats", &st); err != nil {
			return total, err
		}
		total += st.Instance.Waiters
	}
	return total, nil
}

// startInstance runs the whole program with extra environment on free
// ports and returns its proxy and admin addresses; it stops with the test.
func startInstance(t *testing.T, env []string) (proxyAddr, adminAddr string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan [2]string, 1)
	// done is closed once run returned and runErr holds its result, so
	// both the start-up failure below and the cleanup can read it.
	done := make(chan struct{})
	var runErr error
	go func() {
		defer close(done)
		runErr = run(ctx, []string{"-config", writeConfig(t, "log: {level: warn}\n")}, env, io.Discard,
			func(p, a string) { ready <- [2]string{p, a} })
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		if runErr != nil && !t.Failed() {
			t.Errorf("run: %v", runErr)
		}
	})
	select {
	case a := <-ready:
		return a[0], a[1]
	case <-done:
		t.Fatalf("run: %v", runErr)
	}
	return "", ""
}

func plainClient(proxyAddr, user, pass string) *http.Client {
	u := &url.URL{Scheme: "http", Host: proxyAddr}
	if user != "" {
		u.User = url.UserPassword(user, pass)
	}
	return &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(u)}, Timeout: 10 * time.Second}
}

func status(t *testing.T, c *http.Client, u string) (int, string) {
	t.Helper()
	resp, err := c.Get(u)
	if err != nil {
		t.Fatalf("GET %s: %v", u, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("X-Cache") + " " + string(b)
}

// TestGuardEndToEnd: with loopback not allowed, a host name that resolves
// to 127.0.0.x is refused at dial time, a literal at once; the proxy never
// reaches its own admin port, even when loopback is allowed.
func TestGuardEndToEnd(t *testing.T) {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "reached") }))
	defer origin.Close()
	_, port, _ := net.SplitHostPort(origin.Listener.Addr().String())
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	addrs, err := net.LookupHost(host)
	if err != nil || len(addrs) == 0 || !net.ParseIP(addrs[0]).IsLoopback() {
		t.Skipf("this machine's name %q does not resolve to loopback (%v %v): no name to test dial-time refusal with", host, addrs, err)
	}

	closed := append(testEnv(t, httptest.NewTLSServer(nil)), "ONCEPROXY_GUARD_ALLOW_CIDRS=[]")
	p, _ := startInstance(t, closed)
	c := plainClient(p, "", "")
	for _, u := range []string{
		"http://" + host + ":" + port + "/", // resolves to loopback: refused at dial time
		"http://127.0.0.1:" + port + "/",    // literal: refused before any dial
		"http://2130706433:" + port + "/",
	} {
		if st, body := status(t, c, u); st != 403 || !strings.Contains(body, "refusing") {
			t.Fatalf("%s: %d %q", u, st, body)
		}
	}

	open := append(testEnv(t, httptest.NewTLSServer(nil)), "ONCEPROXY_GUARD_ALLOW_CIDRS=[127.0.0.0/8]")
	p2, admin2 := startInstance(t, open)
	c2 := plainClient(p2, "", "")
	if st, body := status(t, c2, "http://"+host+":"+port+"/"); st != 200 || !strings.Contains(body, "reached") {
		t.Fatalf("allowed loopback by name: %d %q", st, body)
	}
	if st, body := status(t, c2, "http://"+admin2+"/cache/stats"); st != 403 || !strings.Contains(body, "own") {
		t.Fatalf("admin API through the proxy port: %d %q", st, body)
	}
	if st, body := status(t, c2, "http://"+p2+"/"); st != 403 {
		t.Fatalf("proxy port through itself: %d %q", st, body)
	}
}

// TestMetricsAfterMixedLoad scrapes /metrics after a known mix of answers.
func TestMetricsAfterMixedLoad(t *testing.T) {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "page") }))
	defer origin.Close()
	env := append(testEnv(t, httptest.NewTLSServer(nil)),
		"ONCEPROXY_AUTH_USERS=[{name: alice, password_env: TEST_ALICE_PW}]", "TEST_ALICE_PW=pw",
		"ONCEPROXY_RATE_LIMIT_REQUESTS=4",
		"ONCEPROXY_ADMIN_TOKEN_ENV=TEST_ADMIN_TOKEN", "TEST_ADMIN_TOKEN=tok")
	p, admin := startInstance(t, env)
	anon, alice := plainClient(p, "", ""), plainClient(p, "alice", "pw")
	for _, step := range []struct {
		c    *http.Client
		url  string
		want int
	}{
		{anon, origin.URL + "/a", 407},
		{alice, origin.URL + "/a", 200},                // MISS (1)
		{alice, origin.URL + "/a", 200},                // HIT (2)
		{alice, "http://169.254.169.254/latest/", 403}, // refused target (3)
		{alice, origin.URL + "/b", 200},                // MISS (4)
		{alice, origin.URL + "/c", 429},                // over 4 per minute
	} {
		if st, body := status(t, step.c, step.url); st != step.want {
			t.Fatalf("%s: %d %q, want %d", step.url, st, body, step.want)
		}
	}
	req, _ := http.NewRequest(http.MethodGet, "http://"+admin+"/metrics", nil)
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 401 {
		t.Fatalf("/metrics without the token: %v %v", err, resp)
	}
	req.Header.Set("Authorization", "Bearer tok")
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("/metrics: %v %v", err, resp)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	text := string(b)
	for _, want := range []string{
		`onceproxy_requests_total{code="2xx",x_cache="MISS"} 2`,
		`onceproxy_requests_total{code="2xx",x_cache="HIT"} 1`,
		`onceproxy_requests_total{code="4xx",x_cache="none"} 3`,
		`onceproxy_auth_failures_total 1`,
		`onceproxy_rate_limited_total 1`,
		`onceproxy_ssrf_refused_total 1`,
		`onceproxy_upstream_requests_total 2`,
		`onceproxy_cache_entries 2`,
		`onceproxy_request_duration_seconds_count{x_cache="HIT"} 1`,
		`onceproxy_log_lines_dropped_total 0`,
	} {
		if !strings.Contains(text, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	if t.Failed() {
		t.Logf("metrics:\n%s", grepLines(text, "onceproxy_"))
	}
}

// metricsText is an instance's /metrics page (admin without a token).
func metricsText(t *testing.T, admin string) string {
	t.Helper()
	resp, err := http.Get("http://" + admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func grepLines(text, prefix string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.HasPrefix(l, prefix) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestRateLimitAcrossInstances: with Redis the limit holds across two
// instances; with Redis down requests pass (fail open).
func TestRateLimitAcrossInstances(t *testing.T) {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "page") }))
	defer origin.Close()
	rs := redistest.Start(t)
	env := func() []string {
		return append(testEnv(t, httptest.NewTLSServer(nil)), "ONCEPROXY_REDIS_URL="+rs.URL,
			"ONCEPROXY_RATE_LIMIT_REQUESTS=3", "ONCEPROXY_REDIS_BREAKER_INTERVAL=200ms")
	}
	a, _ := startInstance(t, env())
	b, _ := startInstance(t, env())
	ca, cb := plainClient(a, "", ""), plainClient(b, "", "")
	for i, c := range []*http.Client{ca, ca, cb} {
		if st, body := status(t, c, fmt.Sprintf("%s/r%d", origin.URL, i)); st != 200 {
			t.Fatalf("request %d: %d %q", i+1, st, body)
		}
	}
	if st, _ := status(t, cb, origin.URL+"/r4"); st != 429 {
		t.Fatalf("4th request across two instances: %d, want 429", st)
	}
	rs.Kill()
	for i := range 6 {
		if st, body := status(t, ca, fmt.Sprintf("%s/down%d", origin.URL, i)); st != 200 {
			t.Fatalf("with Redis down, request %d: %d %q (want fail-open)", i, st, body)
		}
	}
}

// TestSessionCooldownAcrossInstances: two instances share one Redis and one
// provider. A session rate-limited through A is benched on B within a
// moment, without B ever sending it a request: B's request that names the
// session leaves through another one, and the rate-limited exit IP sees
// the fleet once.
func TestSessionCooldownAcrossInstances(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	bad, ok := fp.Session("s1")
	if !ok {
		t.Fatal("no session s1")
	}
	var badHits atomic.Int64
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if ip, _, _ := net.SplitHostPort(r.RemoteAddr); ip == bad.ExitIP {
			badHits.Add(1)
			w.Header().Set("Retry-After", "600")
			http.Error(w, "slow down", http.StatusTooManyRequests)
			return
		}
		io.WriteString(w, "page")
	}))
	defer origin.Close()
	rs := redistest.Start(t)
	env := func() []string {
		return append(testEnv(t, httptest.NewTLSServer(nil)), "ONCEPROXY_REDIS_URL="+rs.URL,
			"ONCEPROXY_UPSTREAM_PROVIDER_API="+fp.APIURL(), "ONCEPROXY_UPSTREAM_PROVIDER_API_KEY="+fp.APIKey())
	}
	a, _ := startInstance(t, env())
	b, bAdmin := startInstance(t, env())
	// News is pub/sub: wait until both instances listen, as a fleet that
	// has been up for a while does.
	rc := rs.Client()
	testkit.Eventually(t, testkit.Patience, func() bool {
		n, err := rc.PubSubNumSub(context.Background(), "onceproxy:v1:events").Result()
		return err == nil && n["onceproxy:v1:events"] == 2
	}, "both instances to subscribe to the events channel")
	get := func(proxyAddr, path string) *http.Response {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, origin.URL+path, nil)
		req.Header.Set("X-Onceproxy-Session", "s1")
		resp, err := plainClient(proxyAddr, "", "").Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	if resp := get(a, "/a"); resp.StatusCode != 200 || resp.Header.Get("X-Onceproxy-Upstream") != "s2" {
		t.Fatalf("A: %d via %q, want 200 via s2 after s1's 429", resp.StatusCode, resp.Header.Get("X-Onceproxy-Upstream"))
	}
	var bSessions struct {
		Sessions []upstream.SessionStatus `json:"sessions"`
	}
	if !testkit.Poll(testkit.Patience, func() bool {
		if err := testkit.GetJSON("http://"+bAdmin+"/upstream/sessions", &bSessions); err != nil {
			return false
		}
		i := slices.IndexFunc(bSessions.Sessions, func(s upstream.SessionStatus) bool { return s.ID == "s1" })
		// Benched at the origin's site: its 429 says nothing of others.
		return i >= 0 && slices.ContainsFunc(bSessions.Sessions[i].CoolingSites, func(c upstream.SiteCooldown) bool {
			return c.Host == strings.TrimPrefix(origin.URL, "http://") && c.Reason == "rate_limited"
		})
	}) {
		t.Fatalf("B never benched s1 at the origin's site: %+v", bSessions.Sessions)
	}
	if resp := get(b, "/b"); resp.StatusCode != 200 || resp.Header.Get("X-Onceproxy-Upstream") != "s2" {
		t.Fatalf("B: %d via %q, want 200 via s2", resp.StatusCode, resp.Header.Get("X-Onceproxy-Upstream"))
	}
	if n := badHits.Load(); n != 1 {
		t.Errorf("the rate-limited exit IP saw the fleet %d times, want 1", n)
	}

	// An instance that starts now recalls the cooldown from Redis.
	c, cAdmin := startInstance(t, env())
	var st struct {
		Sessions []upstream.SessionStatus `json:"sessions"`
	}
	if err := testkit.GetJSON("http://"+cAdmin+"/upstream/sessions", &st); err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(st.Sessions, func(s upstream.SessionStatus) bool { return s.ID == "s1" })
	if i < 0 || !slices.ContainsFunc(st.Sessions[i].CoolingSites, func(c upstream.SiteCooldown) bool {
		return c.Host == strings.TrimPrefix(origin.URL, "http://") && time.Until(c.Until) >= 9*time.Minute
	}) {
		t.Fatalf("a new instance did not recall s1's cooldown at the origin's site: %+v", st.Sessions)
	}
	if resp := get(c, "/c"); resp.StatusCode != 200 || resp.Header.Get("X-Onceproxy-Upstream") != "s2" {
		t.Fatalf("C: %d via %q, want 200 via s2", resp.StatusCode, resp.Header.Get("X-Onceproxy-Upstream"))
	}
}

func writeConfig(t *testing.T, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestMalformedFleetNoteKeepsTheFleetUp is the reproduction of a crash:
// one note with an unknown reason on the events channel took down every
// instance that heard it, and, kept as a lasting cooldown, every instance
// started afterwards. Now the instance keeps serving, its sessions API
// answers, the rejection is counted, and a new instance with the bad note
// still in Redis starts and serves.
func TestMalformedFleetNoteKeepsTheFleetUp(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 1})
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "page") }))
	defer origin.Close()
	rs := redistest.Start(t)
	env := func() []string {
		return append(testEnv(t, httptest.NewTLSServer(nil)), "ONCEPROXY_REDIS_URL="+rs.URL,
			"ONCEPROXY_UPSTREAM_SESSIONS=[{id: s1, url: '"+fp.URL("s1", "http")+"'}]")
	}
	a, aAdmin := startInstance(t, env())
	rc := rs.Client()
	ctx := context.Background()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		n, err := rc.PubSubNumSub(ctx, "onceproxy:v1:events").Result()
		if err == nil && n["onceproxy:v1:events"] == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("instance not subscribed: %v %v", n, err)
		}
	}
	const bad = `{"session":"s1","kind":"cooldown","for":60000000000,"reason":"bogus"}`
	if err := rc.Publish(ctx, "onceproxy:v1:events", "n other session "+bad).Err(); err != nil {
		t.Fatal(err)
	}
	// The same note kept as a lasting cooldown, as an instance would keep
	// it, for instances that start later.
	now, err := rc.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.HSet(ctx, "onceproxy:v1:notes:session", "s1",
		fmt.Sprintf("%d %s", now.Add(time.Minute).UnixMilli(), bad)).Err(); err != nil {
		t.Fatal(err)
	}
	rejected := func(admin string) int {
		var n int
		fmt.Sscanf(grepLines(metricsText(t, admin), "onceproxy_fleet_notes_rejected_total "), "onceproxy_fleet_notes_rejected_total %d", &n)
		return n
	}
	for deadline := time.Now().Add(10 * time.Second); rejected(aAdmin) < 1; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the bad note was never counted as rejected")
		}
	}
	check := func(name, proxyAddr, admin string) {
		t.Helper()
		if code, body := status(t, plainClient(proxyAddr, "", ""), origin.URL+"/"+name); code != 200 || !strings.HasSuffix(body, "page") {
			t.Fatalf("%s after the bad note: %d %q", name, code, body)
		}
		var st struct {
			Sessions []upstream.SessionStatus `json:"sessions"`
		}
		if err := testkit.GetJSON("http://"+admin+"/upstream/sessions", &st); err != nil {
			t.Fatal(err)
		}
		if len(st.Sessions) != 1 || !st.Sessions[0].Available {
			t.Fatalf("%s: sessions after the bad note: %+v", name, st.Sessions)
		}
	}
	check("a", a, aAdmin)
	b, bAdmin := startInstance(t, env())
	check("b", b, bAdmin)
	if n := rejected(bAdmin); n < 1 {
		t.Errorf("the instance started afterwards did not count the recalled bad note (%d)", n)
	}
}

// TestMoneySaved: 4 HITs of a 2 KiB page at 2 per 1,000 requests and 8 per
// GB saved 4 x (0.002 + 2048 x 8 / 10^9) = 0.008065536, in /cache/stats,
// in /metrics and on the status page.
func TestMoneySaved(t *testing.T) {
	page := strings.Repeat("x", 2048)
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, page) }))
	defer origin.Close()
	proxyAddr, admin := startInstance(t, append(testEnv(t, httptest.NewTLSServer(nil)),
		"ONCEPROXY_SAVINGS_PRICE_PER_1000_REQUESTS=2", "ONCEPROXY_SAVINGS_PRICE_PER_GB=8", "ONCEPROXY_SAVINGS_CURRENCY=EUR"))
	c := plainClient(proxyAddr, "", "")
	for i := range 5 {
		if code, body := status(t, c, origin.URL+"/page"); code != 200 || !strings.HasSuffix(body, page) {
			t.Fatalf("request %d: %d", i, code)
		}
	}
	const want = 4 * (2.0/1000 + 2048*8/1e9)
	var st struct {
		Instance struct {
			XCache     map[string]int `json:"x_cache"`
			MoneySaved float64        `json:"money_saved"`
			Currency   string         `json:"currency"`
		} `json:"instance"`
	}
	if err := testkit.GetJSON("http://"+admin+"/cache/stats", &st); err != nil {
		t.Fatal(err)
	}
	if st.Instance.XCache["HIT"] != 4 || math.Abs(st.Instance.MoneySaved-want) > 1e-9 || st.Instance.Currency != "EUR" {
		t.Fatalf("stats: %+v, want 4 HITs saving %v EUR", st.Instance, want)
	}
	line := grepLines(metricsText(t, admin), `onceproxy_money_saved_total{currency="EUR"} `)
	var got float64
	if _, err := fmt.Sscanf(line, `onceproxy_money_saved_total{currency="EUR"} %g`, &got); err != nil || math.Abs(got-want) > 1e-9 {
		t.Fatalf("metric line %q, want %v", line, want)
	}
	resp, err := http.Get("http://" + admin + "/")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), `<b id="money">0.008066 EUR</b>`) {
		t.Errorf("status page lacks the money saved: %s", grepLines(string(b), `<div class="card"><span>money`))
	}
}

// TestProviderKeyInjectedIntoRun: the provider API key named by
// upstream.provider.api_key_env comes from the environment run is given,
// not the process's: the pool lists the provider's sessions with it and a
// request names one of them.
func TestProviderKeyInjectedIntoRun(t *testing.T) {
	const name = "PROVIDER_KEY_FOR_TEST_6d1f"
	if os.Getenv(name) != "" {
		t.Fatalf("%s is set in the process environment; the test needs it unset", name)
	}
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "page") }))
	defer origin.Close()
	env := append(testEnv(t, httptest.NewTLSServer(nil)),
		"ONCEPROXY_UPSTREAM_PROVIDER_API="+fp.APIURL(),
		"ONCEPROXY_UPSTREAM_PROVIDER_API_KEY_ENV="+name, name+"="+fp.APIKey())
	proxyAddr, _ := startInstance(t, env)
	req, _ := http.NewRequest(http.MethodGet, origin.URL+"/", nil)
	req.Header.Set("X-Onceproxy-Session", "s2")
	resp, err := plainClient(proxyAddr, "", "").Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("X-Onceproxy-Upstream") != "s2" {
		t.Fatalf("%d via %q, want 200 via the provider's session s2", resp.StatusCode, resp.Header.Get("X-Onceproxy-Upstream"))
	}
}
