package loadgen

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// itemTargets returns k distinct URLs under base, as cmd/onceload builds them.
func itemTargets(base string, k int) []string {
	targets := make([]string, k)
	for i := range targets {
		targets[i] = fmt.Sprintf("%s/item/%d?q=%d", base, i, i)
	}
	return targets
}

// checkPercentiles fails unless 0 < P50 <= P90 <= P99 <= Max.
func checkPercentiles(t *testing.T, res *Result) {
	t.Helper()
	if res.P50 <= 0 || res.P50 > res.P90 || res.P90 > res.P99 || res.P99 > res.Max {
		t.Errorf("percentiles not ordered: p50 %v p90 %v p99 %v max %v", res.P50, res.P90, res.P99, res.Max)
	}
}

func TestRunDirect(t *testing.T) {
	const (
		n, c, k = 200, 20, 4
		size    = 512
	)
	o := startOrigin(t, OriginOptions{BodySize: size})
	res, err := Run(context.Background(), Options{Targets: itemTargets(o.URL(), k), N: n, C: c})
	if err != nil {
		t.Fatalf("Run(): %v", err)
	}
	if g, e := res.Requests, n; g != e {
		t.Errorf("Requests = %d, want %d", g, e)
	}
	if res.Errors != 0 {
		t.Errorf("Errors = %d (%q), want 0", res.Errors, res.ErrorSamples)
	}
	if g, e := o.Requests(), int64(n); g != e {
		t.Errorf("origin Requests() = %d, want %d", g, e)
	}
	for i := range k {
		path := fmt.Sprintf("/item/%d", i)
		if g, e := o.RequestsFor(path), int64(n/k); g != e {
			t.Errorf("origin RequestsFor(%s) = %d, want %d (round-robin)", path, g, e)
		}
	}
	if g, e := res.Status, map[int]int{200: n}; !maps.Equal(g, e) {
		t.Errorf("Status = %v, want %v", g, e)
	}
	if g, e := res.XCache, map[string]int{"-": n}; !maps.Equal(g, e) {
		t.Errorf("XCache = %v, want %v", g, e)
	}
	if g, e := res.BytesRead, int64(n*size); g != e {
		t.Errorf("BytesRead = %d, want %d", g, e)
	}
	if res.RPS <= 0 || res.Duration <= 0 {
		t.Errorf("RPS = %v, Duration = %v, want both positive", res.RPS, res.Duration)
	}
	checkPercentiles(t, res)
}

// TestRunRepeat: with Repeat, each target is sent that many times in a row
// (here one worker, so the origin sees the order), then the next.
func TestRunRepeat(t *testing.T) {
	arrived := make(chan string, 16)
	o := startOrigin(t, OriginOptions{arrived: arrived})
	res, err := Run(context.Background(), Options{Targets: itemTargets(o.URL(), 2), N: 7, C: 1, Repeat: 3})
	if err != nil || res.Requests != 7 || res.Errors != 0 {
		t.Fatalf("Run() = %+v, %v", res, err)
	}
	close(arrived)
	var got []string
	for p := range arrived {
		got = append(got, strings.TrimPrefix(p, "/item/"))
	}
	if g, e := strings.Join(got, ""), "0001110"; g != e {
		t.Errorf("order of targets = %s, want %s", g, e)
	}
}

func TestRunTLS(t *testing.T) {
	o := startOrigin(t, OriginOptions{TLS: true, BodySize: 64})
	targets := itemTargets(o.URL(), 3)

	t.Run("trusted", func(t *testing.T) {
		res, err := Run(context.Background(), Options{CAFile: o.CAFile(), Targets: targets, N: 30, C: 5})
		if err != nil {
			t.Fatalf("Run(): %v", err)
		}
		if res.Errors != 0 || res.Status[200] != 30 {
			t.Errorf("Errors = %d (%q), Status = %v; want 0 errors and 30 × 200", res.Errors, res.ErrorSamples, res.Status)
		}
		checkPercentiles(t, res)
	})

	t.Run("untrusted", func(t *testing.T) {
		before := o.Requests()
		res, err := Run(context.Background(), Options{Targets: targets, N: 6, C: 2})
		if err != nil {
			t.Fatalf("Run(): %v", err)
		}
		if g, e := res.Errors, 6; g != e {
			t.Errorf("Errors = %d, want %d", g, e)
		}
		if g, e := res.Requests, 6; g != e {
			t.Errorf("Requests = %d, want %d", g, e)
		}
		if len(res.ErrorSamples) != 1 || !strings.Contains(res.ErrorSamples[0], "certificate") {
			t.Errorf("ErrorSamples = %q, want one certificate error (URLs stripped)", res.ErrorSamples)
		}
		if g := o.Requests() - before; g != 0 {
			t.Errorf("origin saw %d requests over untrusted TLS, want 0", g)
		}
	})
}

func TestRunHonoursLatency(t *testing.T) {
	const latency = 50 * time.Millisecond
	o := startOrigin(t, OriginOptions{Latency: latency})
	res, err := Run(context.Background(), Options{Targets: itemTargets(o.URL(), 2), N: 10, C: 5})
	if err != nil {
		t.Fatalf("Run(): %v", err)
	}
	if res.Errors != 0 {
		t.Fatalf("Errors = %d (%q), want 0", res.Errors, res.ErrorSamples)
	}
	if res.P50 < latency {
		t.Errorf("P50 = %v, want >= origin latency %v", res.P50, latency)
	}
	checkPercentiles(t, res)
}

func TestRunTimeout(t *testing.T) {
	o := startOrigin(t, OriginOptions{Latency: time.Hour})
	res, err := Run(context.Background(), Options{
		Targets: []string{o.URL() + "/slow"},
		N:       3,
		C:       3,
		Timeout: 20 * time.Millisecond,
	})
	if err != nil {
		t.Fatalf("Run(): %v", err)
	}
	if g, e := res.Errors, 3; g != e {
		t.Errorf("Errors = %d, want %d", g, e)
	}
	if len(res.ErrorSamples) == 0 || !strings.Contains(res.ErrorSamples[0], "deadline exceeded") {
		t.Errorf("ErrorSamples = %q, want a deadline error", res.ErrorSamples)
	}
}

// TestRunViaProxy proves that requests go through Options.Proxy: a minimal
// forward proxy counts them and marks every response X-Cache: MISS.
func TestRunViaProxy(t *testing.T) {
	const n = 40
	o := startOrigin(t, OriginOptions{BodySize: 32})

	upstream := &http.Transport{} // direct; never the environment's proxy
	t.Cleanup(upstream.CloseIdleConnections)
	var proxied atomic.Int64
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !r.URL.IsAbs() {
			http.Error(w, "want an absolute-form request", http.StatusBadRequest)
			return
		}
		proxied.Add(1)
		out := r.Clone(r.Context())
		out.RequestURI = ""
		resp, err := upstream.RoundTrip(out)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		maps.Copy(w.Header(), resp.Header)
		w.Header().Set("X-Cache", "MISS")
		w.WriteHeader(resp.StatusCode)
		io.Copy(w, resp.Body)
	}))
	t.Cleanup(proxy.Close)
	proxyURL, err := url.Parse(proxy.URL)
	if err != nil {
		t.Fatal(err)
	}

	res, err := Run(context.Background(), Options{
		Proxy:   proxyURL,
		Targets: itemTargets(o.URL(), 1),
		N:       n,
		C:       8,
		Header:  http.Header{"X-Test": {"1"}},
	})
	if err != nil {
		t.Fatalf("Run(): %v", err)
	}
	if res.Errors != 0 {
		t.Fatalf("Errors = %d (%q), want 0", res.Errors, res.ErrorSamples)
	}
	if g, e := res.XCache["MISS"], n; g != e {
		t.Errorf(`XCache["MISS"] = %d, want %d (XCache = %v)`, g, e, res.XCache)
	}
	if g, e := proxied.Load(), int64(n); g != e {
		t.Errorf("proxy saw %d requests, want %d", g, e)
	}
	if g, e := o.Requests(), int64(n); g != e {
		t.Errorf("origin saw %d requests, want %d", g, e)
	}
}

func TestRunHeaderAndMethod(t *testing.T) {
	type seen struct{ method, host, test, acceptEncoding string }
	got := make(chan seen, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- seen{r.Method, r.Host, r.Header.Get("X-Test"), r.Header.Get("Accept-Encoding")}
	}))
	t.Cleanup(srv.Close)

	res, err := Run(context.Background(), Options{
		Targets: []string{srv.URL + "/"},
		Method:  http.MethodHead,
		Header:  http.Header{"Host": {"example.test"}, "X-Test": {"yes"}},
	})
	if err != nil || res.Errors != 0 {
		t.Fatalf("Run(): err %v, errors %q", err, res.ErrorSamples)
	}
	if g, e := <-got, (seen{"HEAD", "example.test", "yes", ""}); g != e {
		t.Errorf("origin saw %+v, want %+v", g, e)
	}
}

// TestRunCancel cancels the run while requests are in flight: Run must
// return promptly with ctx's error and a partial Result that does not count
// the abandoned requests as failures.
func TestRunCancel(t *testing.T) {
	arrived := make(chan string, 10)
	o := startOrigin(t, OriginOptions{Latency: time.Hour, arrived: arrived})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-arrived
		cancel()
	}()

	res, err := Run(ctx, Options{Targets: itemTargets(o.URL(), 2), N: 10, C: 2})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Run() error = %v, want context.Canceled", err)
	}
	if res == nil {
		t.Fatalf("Run() returned no partial Result")
	}
	if res.Requests != 0 || res.Errors != 0 {
		t.Errorf("Requests = %d, Errors = %d (%q); want 0 and 0", res.Requests, res.Errors, res.ErrorSamples)
	}
}

func TestRunOptionErrors(t *testing.T) {
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "not.pem")
	if err := os.WriteFile(notPEM, []byte("hello"), 0o600); err != nil {
		t.Fatal(err)
	}
	valid := []string{"http://127.0.0.1:1/"}
	for _, tc := range []struct {
		name string
		o    Options
	}{
		{"no targets", Options{}},
		{"relative target", Options{Targets: []string{"/item/1"}}},
		{"other scheme", Options{Targets: []string{"ftp://127.0.0.1/"}}},
		{"unparsable target", Options{Targets: []string{"http://[::1"}}},
		{"negative N", Options{Targets: valid, N: -1}},
		{"negative Repeat", Options{Targets: valid, Repeat: -1}},
		{"invalid method", Options{Targets: valid, Method: "BAD METHOD"}},
		{"missing CA file", Options{Targets: valid, CAFile: filepath.Join(dir, "missing.pem")}},
		{"CA file without PEM", Options{Targets: valid, CAFile: notPEM}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if res, err := Run(context.Background(), tc.o); err == nil {
				t.Errorf("Run(): got %v, want an error", res)
			}
		})
	}
}

// startTunnelProxy starts a forward proxy that only handles CONNECT, as a
// plain TCP tunnel (no MITM: the client's TLS ends at the origin). It
// returns the proxy URL and a count of tunnels opened. Tunnels are hijacked
// connections that httptest does not track, so the proxy closes and waits
// for them itself when the test ends.
func startTunnelProxy(t *testing.T) (*url.URL, *atomic.Int64) {
	t.Helper()
	var (
		tunnels atomic.Int64
		wg      sync.WaitGroup
		mu      sync.Mutex // protects conns and closed
		conns   []net.Conn
		closed  bool
	)
	// track registers a tunnel's two connections and its two pumps, unless
	// the proxy is shutting down. wg.Add happens under mu, so it cannot race
	// with the wg.Wait in Cleanup.
	track := func(c ...net.Conn) bool {
		mu.Lock()
		defer mu.Unlock()
		if closed {
			return false
		}
		conns = append(conns, c...)
		wg.Add(len(c))
		return true
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodConnect {
			http.Error(w, "CONNECT only", http.StatusMethodNotAllowed)
			return
		}
		upstream, err := net.Dial("tcp", r.Host)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		client, _, err := http.NewResponseController(w).Hijack()
		if err != nil {
			upstream.Close()
			return
		}
		if !track(client, upstream) {
			client.Close()
			upstream.Close()
			return
		}
		tunnels.Add(1)
		io.WriteString(client, "HTTP/1.1 200 Connection established\r\n\r\n")
		// Each pump closes both ends when its side ends, which stops the other.
		pump := func(dst, src net.Conn) {
			defer wg.Done()
			io.Copy(dst, src)
			dst.Close()
			src.Close()
		}
		go pump(upstream, client)
		go pump(client, upstream)
	}))
	t.Cleanup(func() {
		srv.Close()
		mu.Lock()
		closed = true
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	u, err := url.Parse(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	return u, &tunnels
}

// TestRunViaConnectTunnel sends HTTPS targets through a CONNECT proxy, the
// way requests reach onceproxy's MITM, with HTTP/1.1 and with HTTP/2
// negotiated inside the tunnel.
func TestRunViaConnectTunnel(t *testing.T) {
	o := startOrigin(t, OriginOptions{TLS: true, BodySize: 16})
	for _, tc := range []struct {
		http2 bool
		proto string
	}{
		{false, "HTTP/1.1"},
		{true, "HTTP/2.0"},
	} {
		t.Run(tc.proto, func(t *testing.T) {
			proxyURL, tunnels := startTunnelProxy(t)
			const n = 20
			res, err := Run(context.Background(), Options{
				Proxy:   proxyURL,
				CAFile:  o.CAFile(),
				Targets: itemTargets(o.URL(), 2),
				N:       n,
				C:       4,
				HTTP2:   tc.http2,
			})
			if err != nil {
				t.Fatalf("Run(): %v", err)
			}
			if res.Errors != 0 || res.Protos[tc.proto] != n {
				t.Errorf("Errors = %d (%q), Protos = %v; want 0 errors and %d × %s",
					res.Errors, res.ErrorSamples, res.Protos, n, tc.proto)
			}
			if tunnels.Load() == 0 {
				t.Errorf("no CONNECT tunnel was opened: requests bypassed the proxy")
			}
		})
	}
}
