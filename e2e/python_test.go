package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// needPythonRequests finds python3 ($E2E_PYTHON overrides) with the
// requests package.
func needPythonRequests(t *testing.T) string {
	t.Helper()
	py := os.Getenv("E2E_PYTHON")
	if py == "" {
		py = needClient(t, "python3", "apt-get install python3 python3-requests")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := runCmd(t, ctx, nil, cleanEnv(), py, "-c", "import requests"); err != nil {
		missing(t, "python3 has no requests package (apt-get install python3-requests)")
	}
	return py
}

type fleetSummary struct {
	Requests        int            `json:"requests"`
	OK              int            `json:"ok"`
	XCache          map[string]int `json:"x_cache"`
	Status          map[string]int `json:"status"`
	Errors          []string       `json:"errors"`
	RequestsVersion string         `json:"requests_version"`
}

// runFleet runs e2e/python/fleet.py and checks what it and the origin saw:
// every answer right, the origin asked for each distinct URL exactly once.
func runFleet(t *testing.T, mode string, env []string) {
	const threads, distinct = 32, 50
	py := needPythonRequests(t)
	o := startOrigin(t, 100*time.Millisecond)
	p := startProxy(t, o.CAFile, proxyOpts{})
	in, _ := json.Marshal(map[string]any{
		"base": o.URL, "threads": threads, "distinct": distinct, "mode": mode,
		"proxy": p.URL("", ""), "ca": p.CAFile,
	})
	if mode == "env" {
		env = append(env,
			"HTTPS_PROXY="+p.URL("", ""), "HTTP_PROXY="+p.URL("", ""),
			"REQUESTS_CA_BUNDLE="+p.CAFile)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	start := time.Now()
	out, err := runCmd(t, ctx, in, cleanEnv(env...), py, filepath.Join(repoRoot, "e2e", "python", "fleet.py"))
	if err != nil {
		t.Fatalf("fleet.py: %v", err)
	}
	var s fleetSummary
	if err := json.Unmarshal(out, &s); err != nil {
		t.Fatalf("fleet.py output %q: %v", out, err)
	}
	t.Logf("requests %s: %d threads x %d URLs in %s: %+v", s.RequestsVersion, threads, distinct, time.Since(start).Round(time.Millisecond), s)
	if s.Requests != threads*distinct || s.OK != s.Requests || len(s.Errors) != 0 {
		t.Fatalf("%d requests, %d right answers, errors %v", s.Requests, s.OK, s.Errors)
	}
	// The origin sees exactly the distinct URLs, once each.
	byPath := o.countByPath()
	for i := range distinct {
		if n := byPath[fmt.Sprintf("/data/%d", i)]; n != 1 {
			t.Errorf("origin got /data/%d %d times, want 1", i, n)
		}
	}
	if len(o.requests()) != distinct {
		t.Errorf("origin got %d requests, want %d:\n%s", len(o.requests()), distinct, o.describe())
	}
	st := p.stats(t)
	t.Logf("/cache/stats: %+v", st)
	if st.XCache["MISS"] != distinct || st.UpstreamRequests != distinct || st.Requests != uint64(threads*distinct) {
		t.Errorf("stats %+v: want %d MISS and upstream requests of %d", st, distinct, threads*distinct)
	}
	if s.XCache["MISS"] != distinct || s.XCache["HIT"]+s.XCache["COALESCED"] != threads*distinct-distinct {
		t.Errorf("the fleet saw X-Cache %v", s.XCache)
	}
	if s.XCache["COALESCED"] == 0 {
		t.Errorf("no request waited on another in flight: the fleet did not overlap (X-Cache %v)", s.XCache)
	}
	p.assertLoopbackOnly(t)
}

// TestPythonRequestsFleetEnv: the README's Python recipe, HTTPS_PROXY and
// REQUESTS_CA_BUNDLE in the environment; 32 threads, each with its own
// Session, ask for the same 50 URLs with varying tracking parameters; the
// origin (100 ms per answer) sees the 50 URLs once each.
func TestPythonRequestsFleetEnv(t *testing.T) { runFleet(t, "env", nil) }

// TestPythonRequestsProxiesDict: the Scrapy-style per-call form,
// proxies={"http": ..., "https": ...} and verify=ca.pem, with the
// environment ignored (trust_env = False).
func TestPythonRequestsProxiesDict(t *testing.T) {
	// A proxy variable that would break everything if it were used.
	runFleet(t, "proxies", []string{"HTTPS_PROXY=http://127.0.0.1:9", "REQUESTS_CA_BUNDLE=/nonexistent"})
}
