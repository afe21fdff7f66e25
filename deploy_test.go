package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/redistest"
)

// TestAlertRules runs the alerting rules' unit tests with promtool.
func TestAlertRules(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("promtool is missing (Debian: apt-get install prometheus)")
		}
		t.Skip("promtool not installed (Debian: apt-get install prometheus)")
	}
	for _, args := range [][]string{
		{"check", "rules", "deploy/prometheus/alerts.yaml"},
		{"test", "rules", "deploy/prometheus/alerts_test.yaml"},
	} {
		if out, err := exec.Command(promtool, args...).CombinedOutput(); err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// TestDeployedMetricsAreExported: every metric the shipped alerts and
// dashboard name is exported by a running instance (with a shared store
// and upstream sessions, after a request), so neither can silently watch
// a metric that does not exist.
func TestDeployedMetricsAreExported(t *testing.T) {
	name := regexp.MustCompile(`onceproxy_[a-z0-9_]+`)
	var wanted []string
	for _, f := range []string{"deploy/prometheus/alerts.yaml", "deploy/grafana/onceproxy.json"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range name.FindAllString(string(b), -1) {
			if !slices.Contains(wanted, n) {
				wanted = append(wanted, n)
			}
		}
	}
	if len(wanted) < 10 {
		t.Fatalf("found only %v in the deploy files", wanted)
	}
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 1})
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "page") }))
	defer origin.Close()
	rs := redistest.Start(t)
	proxyAddr, admin := startInstance(t, append(testEnv(t, httptest.NewTLSServer(nil)), "ONCEPROXY_REDIS_URL="+rs.URL,
		"ONCEPROXY_UPSTREAM_SESSIONS=[{id: s1, url: '"+fp.URL("s1", "http")+"'}]"))
	for range 2 {
		if code, _ := status(t, plainClient(proxyAddr, "", ""), origin.URL+"/a"); code != 200 {
			t.Fatalf("request through the instance: %d", code)
		}
	}
	exported := map[string]bool{}
	for _, l := range strings.Split(metricsText(t, admin), "\n") {
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		n, _, _ := strings.Cut(l, "{")
		n, _, _ = strings.Cut(n, " ")
		exported[n] = true
	}
	for _, n := range wanted {
		if !exported[n] {
			t.Errorf("%s is named in the deploy files but not exported", n)
		}
	}
}
