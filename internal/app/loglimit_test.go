package app

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/logbuf"
	"github.com/seed-a3c387e8/onceproxy/internal/loglimit"
)

// TestBadRequestFloodLogsBounded: every refused CONNECT is a warning,
// written before the client has to authenticate, so anyone who can reach
// the port could write lines at will (300 refusals were 300 lines, with
// log.access off) and fill the disk. The process's logger (NewLogger)
// lets a bounded number of lines of one message through and counts the
// rest in onceproxy_log_lines_suppressed_total.
func TestBadRequestFloodLogsBounded(t *testing.T) {
	logs := &logbuf.Buffer{}
	env := []string{
		"ONCEPROXY_PROXY_LISTEN=127.0.0.1:0", "ONCEPROXY_SOCKS5_LISTEN=", "ONCEPROXY_ADMIN_LISTEN=",
		"ONCEPROXY_MITM_CA_DIR=" + t.TempDir(), "ONCEPROXY_LOG_ACCESS=false", "ONCEPROXY_LOG_FORMAT=json",
	}
	cfg, err := LoadConfig(shippedConfig, "", env)
	if err != nil {
		t.Fatal(err)
	}
	logger, level := NewLogger(cfg.Log, logs)
	a, err := Build(cfg, Options{Logger: logger, LogLevel: level})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx) }()
	defer func() { cancel(); <-done }()

	const flood = 300
	start := time.Now()
	for i := range flood {
		c, err := net.DialTimeout("tcp", a.Addrs().Proxy, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		// A port out of range: refused before authentication.
		fmt.Fprintf(c, "CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n", 70000+i, 70000+i)
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("CONNECT %d: %v", i, err)
		}
		resp.Body.Close()
		c.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("CONNECT %d: %d, want 400", i, resp.StatusCode)
		}
	}
	// And requests a client knows will fail: each was a "request failed".
	client := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: a.Addrs().Proxy})}, Timeout: 10 * time.Second}
	defer client.CloseIdleConnections()
	for i := range flood {
		resp, err := client.Get(fmt.Sprintf("http://127.0.0.1:1/%d", i)) // nothing listens on port 1
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadGateway {
			t.Fatalf("GET %d: %d, want 502", i, resp.StatusCode)
		}
	}
	windows := int(time.Since(start)/loglimit.DefaultWindow) + 1
	written := 0
	for _, msg := range []string{"refused CONNECT", "request failed"} {
		n := strings.Count(logs.String(), `"msg":"`+msg+`"`)
		if most := windows * loglimit.DefaultBurst; n > most {
			t.Errorf("a flood of %d wrote %d %q warnings in %d window(s), want at most %d", flood, n, msg, windows, most)
		}
		written += n
	}
	if got := samples(t, scrape(t, a), "onceproxy_log_lines_suppressed_total")[""]; got != float64(2*flood-written) {
		t.Errorf("onceproxy_log_lines_suppressed_total = %v, want the %d lines left out", got, 2*flood-written)
	}
}
