package upstream_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/httpstatus"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestDeadOriginDoesNotBenchSessions: a gateway's "cannot reach the
// target" (CONNECT 502, SOCKS5 connection refused) for an origin that is
// down is the origin's trouble: the request is tried on at most one other
// session, answered 502 with the gateway's reason, and no session cools
// down, so the next request to a live origin is served.
func TestDeadOriginDoesNotBenchSessions(t *testing.T) {
	for _, proto := range []string{"http", "socks5"} {
		t.Run(proto, func(t *testing.T) {
			fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 3})
			o := newOrigin(t, true)
			cfg := providerConfig(fp)
			cfg.Provider.Protocol = proto
			cfg.CAFiles = []string{originCAFile(t, o.Server)}
			logger, _ := testLogger(t)
			p := newPool(t, cfg, logger)
			dead := testkit.DeadAddr(t)

			conns := func() (n int64) {
				for _, id := range []string{"s1", "s2", "s3"} {
					n += fp.Conns(id)
				}
				return n
			}
			checkNoneBenched := func(what string) {
				t.Helper()
				for _, s := range p.Sessions() {
					if !s.Available || s.LastOutcome == "connection_error" {
						t.Errorf("%s: session %s benched: %+v", what, s.ID, s)
					}
				}
			}

			_, err := send(t, p, http.MethodPost, "https://"+dead+"/x", clientinfo.Info{}, "body")
			var tu *upstream.TargetUnreachableError
			if st, _ := httpstatus.Of(err); !errors.As(err, &tu) || st != http.StatusBadGateway || errors.Is(err, upstream.ErrExhausted) {
				t.Fatalf("POST to a dead origin: err = %v (status %d), want a 502 TargetUnreachableError", err, st)
			}
			if n := conns(); n > 2 {
				t.Errorf("a dead origin was tried through %d gateway connections, want at most 2", n)
			}
			checkNoneBenched("after a request")
			// Plain http goes to an HTTP gateway in absolute form, whose
			// 502 says in Proxy-Status that it could not reach the target
			// (through a SOCKS5 gateway it goes the way https does).
			before := conns()
			_, err = send(t, p, http.MethodPost, "http://"+dead+"/x", clientinfo.Info{}, "body")
			if st, _ := httpstatus.Of(err); !errors.As(err, &tu) || st != http.StatusBadGateway || proto == "http" && !strings.Contains(err.Error(), "destination_unavailable") {
				t.Fatalf("plain POST to a dead origin: err = %v (status %d), want a 502 TargetUnreachableError with the gateway's reason", err, st)
			}
			if n := conns() - before; n > 2 {
				t.Errorf("a dead origin was tried through %d gateway connections for plain http, want at most 2", n)
			}
			checkNoneBenched("after a plain request")
			if r := mustGet(t, p, o.URL, clientinfo.Info{}); r.status != 200 {
				t.Fatalf("live origin afterwards: %+v", r)
			}

			before = conns()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			c, err := p.DialContext(ctx, "tcp", dead)
			if err == nil {
				c.Close()
				t.Fatal("tunnel to a dead origin opened")
			}
			if st, _ := httpstatus.Of(err); !errors.As(err, &tu) || st != http.StatusBadGateway {
				t.Fatalf("tunnel to a dead origin: err = %v, want a 502 TargetUnreachableError", err)
			}
			if n := conns() - before; n > 2 {
				t.Errorf("a dead origin's tunnel was tried through %d gateway connections, want at most 2", n)
			}
			checkNoneBenched("after a tunnel")
		})
	}
}

// TestPlain407IsAuthFailure: a gateway's 407 to a plain-http
// (absolute-form) request is the session's refused credentials, marked
// like a 407 to CONNECT, and never passed to the client.
func TestPlain407IsAuthFailure(t *testing.T) {
	gw := startHTTPGateway(t, "u", "right")
	o := newOrigin(t, false)
	logger, _ := testLogger(t)
	p := newPool(t, upstream.Config{Sessions: []upstream.SessionConfig{{ID: "a", URL: "http://u:wrong@" + gw.srv.Listener.Addr().String()}}}, logger)
	r, err := send(t, p, http.MethodGet, o.URL+"/x", clientinfo.Info{}, "")
	if err == nil {
		t.Fatalf("plain GET with refused credentials answered %d (Proxy-Authenticate %q), want an error",
			r.status, r.header.Get("Proxy-Authenticate"))
	}
	if !strings.Contains(err.Error(), "407") {
		t.Errorf("error does not say why: %v", err)
	}
	if st := statusOf(t, p, "a"); st.Available || st.LastOutcome != "connection_error" {
		t.Errorf("session after a 407: %+v, want connection_error and cooling", st)
	}
}

// TestHealthProbe407IsNoSuccess: a health probe answered 407 by the gateway is
// a failure, not a success.
func TestHealthProbe407IsNoSuccess(t *testing.T) {
	gw := startHTTPGateway(t, "u", "right")
	o := newOrigin(t, false)
	logger, _ := testLogger(t)
	p := newPool(t, upstream.Config{
		Sessions: []upstream.SessionConfig{{ID: "a", URL: "http://u:wrong@" + gw.srv.Listener.Addr().String()}},
		Health:   upstream.HealthConfig{URL: o.URL + "/ip", Interval: 20 * time.Millisecond, Timeout: time.Second},
	}, logger)
	runPool(t, p)
	testkit.Eventually(t, testkit.Patience, func() bool {
		st := statusOf(t, p, "a")
		return !st.Available && st.LastOutcome == "connection_error"
	}, "a probe answered 407 marks the session")
}

// TestConnectReplyHeadBounded: a gateway that answers CONNECT with
// an endless header fails the dial with a clear error once the head
// passes its bound, instead of being buffered until the deadline.
func TestConnectReplyHeadBounded(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
	})
	wg.Go(func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		br := bufio.NewReader(c)
		for {
			l, err := br.ReadString('\n')
			if err != nil || l == "\r\n" {
				break
			}
		}
		io.WriteString(c, "HTTP/1.1 200 OK\r\n")
		line := "X-A: " + strings.Repeat("a", 4000) + "\r\n"
		for total := 0; total < 8<<20; total += len(line) {
			if _, err := io.WriteString(c, line); err != nil {
				return
			}
		}
		_, _ = io.Copy(io.Discard, c) // until the client hangs up
	})
	p := newPool(t, upstream.Config{URL: "http://u:p@" + ln.Addr().String(), DialTimeout: 5 * time.Second}, quiet)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := p.DialContext(ctx, "tcp", "example.invalid:443")
	if err == nil {
		c.Close()
		t.Fatal("tunnel opened through an endless CONNECT reply")
	}
	if !strings.Contains(err.Error(), "exceeds") {
		t.Fatalf("err = %v, want the reply head's bound", err)
	}
}

// banBodyPool is a one-session pool with a ban_body rule and one attempt
// per request, through a fresh gateway, to origin o.
func banBodyPool(t *testing.T, o *origin, idle time.Duration) *upstream.Pool {
	gw := startHTTPGateway(t, "u", "p")
	return newPool(t, upstream.Config{
		Sessions:    []upstream.SessionConfig{{ID: "a", URL: "http://u:p@" + gw.srv.Listener.Addr().String()}},
		Rules:       []upstream.RuleConfig{{BanBody: "blocked"}},
		CAFiles:     []string{originCAFile(t, o.Server)},
		Retry:       upstream.RetryConfig{MaxAttempts: 1},
		IdleTimeout: idle,
	}, quiet)
}

// TestBanBodyTruncated: with ban_body, a body cut short inside the
// scanned prefix never passes for a complete one.
func TestBanBodyTruncated(t *testing.T) {
	o := newOrigin(t, true)
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		w.WriteHeader(200)
		io.WriteString(w, strings.Repeat("x", 1000))
		w.(http.Flusher).Flush()
		c, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			c.Close() // cut mid-body: chunked, without its last chunk
		}
		return true
	})
	p := banBodyPool(t, o, 0)
	req, _ := http.NewRequest(http.MethodGet, o.URL+"/x", nil)
	resp, err := p.RoundTrip(req)
	if err != nil {
		return // the truncation surfaced
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err == nil {
		t.Fatalf("a truncated body read as complete: %d bytes, no error", len(b))
	}
}

// TestBanBodyReadErrorIsAnError: a read error while scanning for the
// ban body on the last attempt is answered as an error, not as a response
// whose body is already closed.
func TestBanBodyReadErrorIsAnError(t *testing.T) {
	o := newOrigin(t, true)
	release := make(chan struct{})
	t.Cleanup(func() { close(release) }) // runs before the origin closes
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		w.WriteHeader(200)
		io.WriteString(w, strings.Repeat("x", 1000))
		w.(http.Flusher).Flush()
		<-release // silent past the pool's idle timeout
		return true
	})
	p := banBodyPool(t, o, 200*time.Millisecond)
	req, _ := http.NewRequest(http.MethodGet, o.URL+"/x", nil)
	resp, err := p.RoundTrip(req)
	if err == nil {
		b, rerr := io.ReadAll(resp.Body)
		resp.Body.Close()
		t.Fatalf("RoundTrip = %d with a dead body (read %d bytes, %v), want an error", resp.StatusCode, len(b), rerr)
	}
	if st, _ := httpstatus.Of(err); st == http.StatusServiceUnavailable {
		t.Errorf("err = %v: a 503, want a 502 naming the body read", err)
	}
	if !strings.Contains(err.Error(), "read response body") {
		t.Errorf("err = %v, want the reason", err)
	}
}

// TestRotateFailureNoStorm: concurrent 429s on a session whose
// provider rotate API fails: the flights queued behind the failed rotation
// do not call the API again.
func TestRotateFailureNoStorm(t *testing.T) {
	o := newOrigin(t, false)
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		time.Sleep(100 * time.Millisecond)
		http.Error(w, "slow down", http.StatusTooManyRequests)
		return true
	})
	gw := startHTTPGateway(t, "u", "p")
	host, port, _ := net.SplitHostPort(gw.srv.Listener.Addr().String())
	var mu sync.Mutex
	rotates := map[string]int{}
	var total atomic.Int64
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			mu.Lock()
			rotates[r.URL.Path]++
			mu.Unlock()
			total.Add(1)
			time.Sleep(200 * time.Millisecond)
			http.Error(w, "oops", http.StatusInternalServerError)
			return
		}
		fmt.Fprintf(w, `{"sessions":[{"id":"s1","username":"u","password":"p","gateway_host":%q,"http_port":%s},`+
			`{"id":"s2","username":"u","password":"p","gateway_host":%q,"http_port":%s}]}`, host, port, host, port)
	}))
	t.Cleanup(api.Close)
	logger, _ := testLogger(t)
	p := newPool(t, upstream.Config{Provider: upstream.ProviderConfig{API: api.URL, APIKey: "k"}}, logger)
	const n = 8
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(clientinfo.With(context.Background(), clientinfo.Info{Session: "s1"}), 10*time.Second)
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, o.URL, nil)
			if resp, err := p.RoundTrip(req); err == nil {
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	if total.Load() == 0 {
		t.Fatal("no rotation was tried")
	}
	for path, c := range rotates {
		if c > 1 {
			t.Errorf("%s: %d rotate API calls for %d concurrent 429s, want 1", path, c, n)
		}
	}
}

// TestTunnelKeepsTheGatewaysRetryAfter: a gateway that answers a tunnel's
// CONNECT with 429 and a Retry-After cools the session for that long, as
// it does for a request sent through it. The tunnel's path dropped the
// Retry-After: a minute's cooldown against the gateway's fifteen.
func TestTunnelKeepsTheGatewaysRetryAfter(t *testing.T) {
	gateway := testkit.RawHTTP(t, "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 900\r\nContent-Length: 0\r\n\r\n")
	logger, _ := testLogger(t)
	p := newPool(t, upstream.Config{Sessions: []upstream.SessionConfig{{ID: "a", URL: "http://u:p@" + gateway}}}, logger)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if c, err := p.DialContext(ctx, "tcp", "127.0.0.1:9"); err == nil {
		c.Close()
		t.Fatal("a tunnel opened through a gateway that answered 429")
	}
	if left := time.Until(statusOf(t, p, "a").CooldownUntil); left < 14*time.Minute {
		t.Errorf("Retry-After: 900, but the session cools for %s", left.Round(time.Second))
	}
}

// TestPlainGatewayAnswerBodyBounded: a gateway's own answer to a
// plain-http request (a 407, a 5xx that says it could not reach the
// target) is read for the first line of its body, the reason. A body
// that stalls (a Content-Length it never sends) held the request until
// its caller gave up (the flight's 60s), and then the session was not
// even charged: the failure looked like the caller's. It is bounded as
// the same answer to CONNECT is, by dial_timeout.
func TestPlainGatewayAnswerBodyBounded(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { close(done); ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				for {
					if l, err := br.ReadString('\n'); err != nil || l == "\r\n" {
						break
					}
				}
				io.WriteString(c, "HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 100\r\n\r\nbad creds")
				<-done
			}()
		}
	}()
	logger, _ := testLogger(t)
	p := newPool(t, upstream.Config{DialTimeout: 300 * time.Millisecond,
		Sessions: []upstream.SessionConfig{{ID: "a", URL: "http://u:pw@" + ln.Addr().String()}}}, logger)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://127.0.0.1:9/x", nil)
	start := time.Now()
	resp, err := p.RoundTrip(req)
	took := time.Since(start)
	if err == nil {
		resp.Body.Close()
		t.Fatalf("answered %d, want the gateway's 407 as an error", resp.StatusCode)
	}
	if took > 2*time.Second || !strings.Contains(err.Error(), "407") {
		t.Errorf("after %v: %v; want the 407 within dial_timeout (300ms)", took, err)
	}
	if st := statusOf(t, p, "a"); st.Available || st.LastOutcome != "connection_error" {
		t.Errorf("session after a 407: %+v, want connection_error and cooling", st)
	}
}
