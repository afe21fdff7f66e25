package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
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

// TestSIGTERMDrainsInFlight runs the real binary, sends SIGTERM while a
// request is in flight through the MITM, and expects the request to finish
// and the process to exit 0.
func TestSIGTERMDrainsInFlight(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	bin := filepath.Join(t.TempDir(), "onceproxy")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	origin := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		<-release
		io.WriteString(w, "drained")
	}))
	defer origin.Close()

	cmd := exec.Command(bin, "-config", writeConfig(t, "log: {format: json}\n"))
	cmd.Env = append(os.Environ(), testEnv(t, origin)...)
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()

	// Read the bound addresses from the log.
	var proxyAddr, adminAddr string
	sc := bufio.NewScanner(stderr)
	var logLines []string
	for (proxyAddr == "" || adminAddr == "") && sc.Scan() {
		line := sc.Text()
		logLines = append(logLines, line)
		if strings.Contains(line, `"msg":"proxy listening"`) {
			proxyAddr = jsonField(line, "addr")
		}
		if strings.Contains(line, `"msg":"admin listening"`) {
			adminAddr = jsonField(line, "addr")
		}
	}
	if proxyAddr == "" || adminAddr == "" {
		t.Fatalf("no listen lines in:\n%s", strings.Join(logLines, "\n"))
	}
	go io.Copy(io.Discard, stderr)

	resp, err := http.Get("http://" + adminAddr + "/ca.pem")
	if err != nil {
		t.Fatal(err)
	}
	caPEM, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	c := proxyClient(t, proxyAddr, caPEM)

	result := make(chan string, 1)
	go func() {
		resp, err := c.Get(origin.URL + "/slow")
		if err != nil {
			result <- "error: " + err.Error()
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		result <- fmt.Sprintf("%d %s", resp.StatusCode, b)
	}()
	<-started
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// Give the signal a moment to be delivered before the origin answers;
	// the request must survive the shutdown either way.
	time.Sleep(200 * time.Millisecond)
	close(release)
	if got := <-result; got != "200 drained" {
		t.Fatalf("in-flight request during SIGTERM: %s", got)
	}
	waitErr := make(chan error, 1)
	go func() { waitErr <- cmd.Wait() }()
	select {
	case err := <-waitErr:
		if err != nil {
			t.Fatalf("process exit: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("process did not exit after SIGTERM")
	}
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
