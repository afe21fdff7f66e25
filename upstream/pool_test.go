package upstream_test

import (
	"bufio"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/logbuf"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

func testLogger(t *testing.T) (*slog.Logger, *logbuf.Buffer) {
	t.Helper()
	lb := &logbuf.Buffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("pool log:\n%s", lb.String())
		}
	})
	return slog.New(slog.NewTextHandler(lb, &slog.HandlerOptions{Level: slog.LevelDebug})), lb
}

// origin is a loopback origin that answers with the caller's IP (the exit
// IP) and counts hits per IP. behave, when set, may answer instead.
type origin struct {
	*httptest.Server
	mu     sync.Mutex
	hits   map[string]int
	seen   []string
	behave func(ip string, w http.ResponseWriter, r *http.Request) bool
}

func newOrigin(t *testing.T, useTLS bool) *origin {
	t.Helper()
	o := &origin{hits: map[string]int{}}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ip, _, _ := net.SplitHostPort(r.RemoteAddr)
		o.mu.Lock()
		o.hits[ip]++
		o.seen = append(o.seen, ip)
		behave := o.behave
		o.mu.Unlock()
		if behave != nil && behave(ip, w, r) {
			return
		}
		io.WriteString(w, ip)
	})
	if useTLS {
		o.Server = httptest.NewTLSServer(h)
	} else {
		o.Server = httptest.NewServer(h)
	}
	t.Cleanup(o.Close)
	return o
}

func (o *origin) setBehave(f func(ip string, w http.ResponseWriter, r *http.Request) bool) {
	o.mu.Lock()
	o.behave = f
	o.mu.Unlock()
}

// rateLimit makes the origin answer 429 with Retry-After to exit IP ip.
func (o *origin) rateLimit(ip string, retryAfter time.Duration) {
	o.setBehave(func(from string, w http.ResponseWriter, r *http.Request) bool {
		if from != ip {
			return false
		}
		w.Header().Set("Retry-After", strconv.Itoa(int(retryAfter/time.Second)))
		http.Error(w, "slow down", http.StatusTooManyRequests)
		return true
	})
}

func (o *origin) ips() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]string(nil), o.seen...)
}

func (o *origin) hitsOf(ip string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.hits[ip]
}

func newPool(t *testing.T, cfg upstream.Config, logger *slog.Logger) *upstream.Pool {
	t.Helper()
	p, err := upstream.New(cfg, logger)
	if err != nil {
		t.Fatalf("upstream.New: %v", err)
	}
	t.Cleanup(p.Close)
	return p
}

func providerConfig(fp *fakeprovider.Provider) upstream.Config {
	return upstream.Config{Provider: upstream.ProviderConfig{API: fp.APIURL(), APIKey: fp.APIKey()}}
}

type result struct {
	status   int
	body     string
	upstream string
	header   http.Header
}

// send makes one request through rt as a client with info would.
func send(t *testing.T, rt http.RoundTripper, method, u string, info clientinfo.Info, body string) (result, error) {
	t.Helper()
	return sendAs(t, client{}, rt, method, u, info, body)
}

// sendAs is send for requests of client c.
func sendAs(t *testing.T, c client, rt http.RoundTripper, method, u string, info clientinfo.Info, body string) (result, error) {
	t.Helper()
	var rb io.Reader
	if body != "" {
		rb = strings.NewReader(body)
	}
	ctx, cancel := context.WithTimeout(clientinfo.With(context.Background(), info), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, u, rb)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := rt.RoundTrip(c.request(req))
	if err != nil {
		return result{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return result{}, err
	}
	return result{resp.StatusCode, string(b), resp.Header.Get(upstream.HeaderUpstream), resp.Header}, nil
}

func mustGet(t *testing.T, rt http.RoundTripper, u string, info clientinfo.Info) result {
	t.Helper()
	r, err := send(t, rt, http.MethodGet, u, info, "")
	if err != nil {
		t.Fatalf("GET %s: %v", u, err)
	}
	return r
}

func statusOf(t *testing.T, p *upstream.Pool, id string) upstream.SessionStatus {
	t.Helper()
	for _, s := range p.Sessions() {
		if s.ID == id {
			return s
		}
	}
	t.Fatalf("no session %s in %+v", id, p.Sessions())
	return upstream.SessionStatus{}
}

func exitIP(t *testing.T, fp *fakeprovider.Provider, id string) string {
	t.Helper()
	s, ok := fp.Session(id)
	if !ok {
		t.Fatalf("fake provider has no session %s", id)
	}
	return s.ExitIP
}

func TestStickyHintOneExitIPAndRotationFollows(t *testing.T) {
	bothWays(t, testStickyHintOneExitIPAndRotationFollows)
}

func testStickyHintOneExitIPAndRotationFollows(t *testing.T, c client) {
	for _, useTLS := range []bool{false, true} {
		t.Run(fmt.Sprintf("tls=%v", useTLS), func(t *testing.T) {
			fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 4})
			o := newOrigin(t, useTLS)
			cfg := providerConfig(fp)
			if useTLS {
				cfg.CAFiles = []string{originCAFile(t, o.Server)}
			}
			logger, _ := testLogger(t)
			p := newPool(t, cfg, logger)

			hint := clientinfo.Info{Account: "acme", Session: "crawl_7"}
			first := c.mustGet(t, p, o.URL, hint)
			for range 19 {
				r := c.mustGet(t, p, o.URL, hint)
				if r.body != first.body || r.upstream != first.upstream {
					t.Fatalf("hint moved: %s via %s, then %s via %s", first.body, first.upstream, r.body, r.upstream)
				}
			}
			if len(o.hits) != 1 || o.hitsOf(first.body) != 20 {
				t.Fatalf("origin saw %v, want one exit IP 20 times", o.hits)
			}
			if first.body != exitIP(t, fp, first.upstream) {
				t.Fatalf("exit IP %s is not session %s's (%s)", first.body, first.upstream, exitIP(t, fp, first.upstream))
			}
			// Sticky sessions keep their connection: one gateway
			// connection for 20 requests.
			if c := fp.Conns(first.upstream); c != 1 {
				t.Errorf("sticky session used %d gateway connections for 20 requests, want 1", c)
			}

			// Different hints spread over the sessions.
			used := map[string]bool{}
			for i := range 40 {
				used[c.mustGet(t, p, o.URL, clientinfo.Info{Account: "acme", Session: fmt.Sprint("h", i)}).upstream] = true
			}
			if len(used) < 3 {
				t.Errorf("40 hints used only sessions %v", used)
			}

			// Rotating the session changes the exit IP; the hint follows.
			if err := p.Rotate(context.Background(), first.upstream); err != nil {
				t.Fatal(err)
			}
			r := c.mustGet(t, p, o.URL, hint)
			if r.upstream != first.upstream || r.body == first.body || r.body != exitIP(t, fp, first.upstream) {
				t.Fatalf("after rotation: %s via %s (was %s; provider says %s)", r.body, r.upstream, first.body, exitIP(t, fp, first.upstream))
			}
			if st := statusOf(t, p, first.upstream); st.ExitIP != r.body || st.Rotations != 1 {
				t.Errorf("status after rotation: exit_ip %q rotations %d, want %s and 1", st.ExitIP, st.Rotations, r.body)
			}
			if useTLS {
				c.mirrored(t, p)
			}
		})
	}
}

func TestPerRequestNewIPEveryRequest(t *testing.T) {
	bothWays(t, testPerRequestNewIPEveryRequest)
}

func testPerRequestNewIPEveryRequest(t *testing.T, c client) {
	for _, useTLS := range []bool{false, true} {
		t.Run(fmt.Sprintf("tls=%v", useTLS), func(t *testing.T) {
			fp := fakeprovider.Start(t, fakeprovider.Options{Rotation: fakeprovider.PerRequest})
			o := newOrigin(t, useTLS)
			cfg := providerConfig(fp)
			if useTLS {
				cfg.CAFiles = []string{originCAFile(t, o.Server)}
			}
			logger, _ := testLogger(t)
			p := newPool(t, cfg, logger)
			prev := ""
			for i := range 10 {
				r := c.mustGet(t, p, o.URL, clientinfo.Info{})
				if r.body == prev {
					t.Fatalf("request %d left from %s like the one before", i, r.body)
				}
				prev = r.body
			}
			if n := fp.Conns("s1"); n != 10 {
				t.Fatalf("per_request session used %d gateway connections for 10 requests, want 10", n)
			}
			if useTLS {
				c.mirrored(t, p)
			}
		})
	}
}

func TestSOCKS5Sessions(t *testing.T) {
	bothWays(t, testSOCKS5Sessions)
}

func testSOCKS5Sessions(t *testing.T, c client) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	plain := newOrigin(t, false)
	tlsO := newOrigin(t, true)
	cfg := providerConfig(fp)
	cfg.Provider.Protocol = "socks5"
	cfg.CAFiles = []string{originCAFile(t, tlsO.Server)}
	logger, _ := testLogger(t)
	p := newPool(t, cfg, logger)
	for _, st := range p.Sessions() {
		if !strings.HasPrefix(st.Proxy, "socks5://") {
			t.Fatalf("session %s is not socks5: %s", st.ID, st.Proxy)
		}
	}
	for _, id := range []string{"s1", "s2"} {
		for _, o := range []*origin{plain, tlsO} {
			r := c.mustGet(t, p, o.URL, clientinfo.Info{Session: id})
			if r.upstream != id || r.body != exitIP(t, fp, id) {
				t.Fatalf("%s: %s via %s, want %s", id, r.body, r.upstream, exitIP(t, fp, id))
			}
		}
	}
	// A static socks5 session from the config works the same way.
	static := newPool(t, upstream.Config{Sessions: []upstream.SessionConfig{{ID: "sx", URL: fp.URL("s2", "socks5")}}}, logger)
	if r := c.mustGet(t, static, plain.URL, clientinfo.Info{}); r.upstream != "sx" || r.body != exitIP(t, fp, "s2") {
		t.Fatalf("static socks5: %+v", r)
	}
	c.mirrored(t, p)
}

// TestRateLimitedRotateAndRetry: the origin answers 429 to one exit IP.
// The session is rotated through the API, the request retried, the client
// gets 200, every concurrent caller too, and the session's status shows the
// penalty.
func TestRateLimitedRotateAndRetry(t *testing.T) {
	bothWays(t, testRateLimitedRotateAndRetry)
}

func testRateLimitedRotateAndRetry(t *testing.T, c client) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	// Mirrored: over TLS, which the mirror carries through the gateway's
	// CONNECT (plain http goes to an HTTP gateway in absolute form).
	o := newOrigin(t, c.fp != nil)
	bad := exitIP(t, fp, "s1")
	const callers = 10
	var arrived atomic.Int32
	release := make(chan struct{})
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		if ip != bad {
			return false
		}
		// Hold the 429s until every caller is in flight on s1, so they
		// all hit the wall at the same time.
		if arrived.Add(1) == callers {
			close(release)
		}
		select {
		case <-release:
		case <-time.After(5 * time.Second):
		}
		http.Error(w, "slow down", http.StatusTooManyRequests)
		return true
	})
	logger, logs := testLogger(t)
	cfg := providerConfig(fp)
	if c.fp != nil {
		cfg.CAFiles = []string{originCAFile(t, o.Server)}
	}
	p := newPool(t, cfg, logger)

	var wg sync.WaitGroup
	results := make([]result, callers)
	errs := make([]error, callers)
	for i := range callers {
		wg.Go(func() {
			// An explicit hint naming s1: every caller starts there.
			results[i], errs[i] = c.send(t, p, http.MethodGet, o.URL+"/page", clientinfo.Info{Session: "s1", Key: "v1:page"}, "")
		})
	}
	wg.Wait()
	for i := range callers {
		if errs[i] != nil || results[i].status != 200 {
			t.Fatalf("caller %d: %v %+v", i, errs[i], results[i])
		}
		if results[i].body == bad {
			t.Fatalf("caller %d got an answer from the rate-limited IP", i)
		}
	}
	if n := fp.Rotations("s1"); n != 1 {
		t.Errorf("s1 rotated %d times for one wall, want 1", n)
	}
	if o.hitsOf(bad) != callers {
		t.Errorf("rate-limited IP got %d requests, want %d (one each)", o.hitsOf(bad), callers)
	}
	st := statusOf(t, p, "s1")
	// Ten 429s at once are one wall: weight 5-2, the 429's 60 s, at the
	// origin's site alone. Counted ten times, they benched s1 (and the new
	// exit IP the wall gave it) for the 10 minutes of 3+ failures in a
	// row.
	last := map[string]bool{"rate_limited": true}
	if c.fp != nil {
		// Over TLS the requests ride the gateway's tunnels, which the
		// provider cuts when it rotates the session: a 429 still on its
		// way arrives as a cut connection (a failure all the same, and
		// the caller still gets its 200 elsewhere).
		last["connection_error"] = true
	}
	sc, cooling := coolingAt(t, st, o.URL)
	if st.Weight != 3 || !cooling || sc.Reason != "rate_limited" || !st.Available ||
		!last[st.LastOutcome] || st.ExitIP == bad || st.Rotations != 1 {
		t.Errorf("s1 status after the wall: %+v", st)
	}
	if left := time.Until(sc.Until); left < 50*time.Second || left > time.Minute {
		t.Errorf("cooldown left %v, want the 429's minute", left)
	}
	if !strings.Contains(logs.String(), "upstream session rotated") {
		t.Errorf("no rotation in the log")
	}
	c.mirrored(t, p)
}

// TestRateLimitedSingleCaller checks the arithmetic of one 429 exactly.
func TestRateLimitedSingleCaller(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, false)
	bad := exitIP(t, fp, "s1")
	o.rateLimit(bad, 600*time.Second)
	logger, _ := testLogger(t)
	p := newPool(t, providerConfig(fp), logger)
	r := mustGet(t, p, o.URL, clientinfo.Info{Session: "s1"})
	if r.status != 200 || r.upstream != "s2" {
		t.Fatalf("got %+v, want 200 from s2", r)
	}
	st := statusOf(t, p, "s1")
	sc, cooling := coolingAt(t, st, o.URL)
	if st.Weight != 3 || !cooling || sc.Reason != "rate_limited" || !st.Available || st.Rotations != 1 {
		t.Errorf("s1 after one 429: %+v", st)
	}
	// Retry-After: 600 makes the cooldown at least 600s (not the default 60s).
	if left := time.Until(sc.Until); left < 590*time.Second || left > 601*time.Second {
		t.Errorf("cooldown left %v, want about 600s (Retry-After)", left)
	}
	if st2 := statusOf(t, p, "s2"); st2.Weight != 6 || st2.LastOutcome != "ok" {
		t.Errorf("s2 after a success: %+v", st2)
	}
	// While s1 cools, its hint is served by s2 (only s1's keys moved).
	if r := mustGet(t, p, o.URL, clientinfo.Info{Session: "s1"}); r.upstream != "s2" {
		t.Errorf("cooling s1's hint went to %s", r.upstream)
	}
}

// TestRetryOnlyForRetryMethods: a POST that gets a 429 comes back as is,
// after one request; a rule can make POST retryable, and the body is then
// replayed intact.
func TestRetryOnlyForRetryMethods(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, false)
	bad := exitIP(t, fp, "s1")
	var bodies []string
	var mu sync.Mutex
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		bodies = append(bodies, string(b))
		mu.Unlock()
		if ip == bad {
			http.Error(w, "slow down", http.StatusTooManyRequests)
			return true
		}
		fmt.Fprintf(w, "got %s", b)
		return true
	})
	logger, _ := testLogger(t)
	p := newPool(t, providerConfig(fp), logger)
	r, err := send(t, p, http.MethodPost, o.URL+"/submit", clientinfo.Info{Session: "s1"}, "form=1")
	if err != nil || r.status != 429 || r.upstream != "s1" {
		t.Fatalf("POST: %v %+v, want the 429 from s1", err, r)
	}
	if len(o.ips()) != 1 || fp.Rotations("s1") != 0 {
		t.Fatalf("POST was sent %d times, s1 rotated %d times; want 1 and 0", len(o.ips()), fp.Rotations("s1"))
	}

	cfg := providerConfig(fp)
	cfg.Rules = []upstream.RuleConfig{{Host: "127.0.0.1", PathPrefix: "/submit", RetryMethods: []string{"POST"}}}
	p2 := newPool(t, cfg, logger)
	// s1 is healthy in this new pool; its exit IP is the one the origin
	// rate-limits... after the rotation above? No rotation happened.
	r, err = send(t, p2, http.MethodPost, o.URL+"/submit", clientinfo.Info{Session: "s1"}, "form=2")
	if err != nil || r.status != 200 || r.body != "got form=2" || r.upstream != "s2" {
		t.Fatalf("retryable POST: %v %+v", err, r)
	}
	mu.Lock()
	defer mu.Unlock()
	if got := bodies[len(bodies)-2:]; got[0] != "form=2" || got[1] != "form=2" {
		t.Fatalf("bodies sent %q, want the body twice", got)
	}
}

// TestRulePathIsTheKeyedPath: a rule's path_prefix holds for the path as
// it is keyed and answered (urlcanon.Path, as dedup rules match it), dot-
// segments resolved: "/x/../submit" is under "/submit", "/submit/../other"
// is not.
func TestRulePathIsTheKeyedPath(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, false)
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		if s, _ := fp.Session("s1"); ip == s.ExitIP {
			http.Error(w, "slow down", http.StatusTooManyRequests)
			return true
		}
		return false
	})
	logger, _ := testLogger(t)
	cfg := providerConfig(fp)
	cfg.Rules = []upstream.RuleConfig{{Host: "127.0.0.1", PathPrefix: "/submit", RetryMethods: []string{"POST"}}}
	for _, tc := range []struct {
		path       string
		retried    bool
		wantStatus int
	}{{"/x/../submit", true, 200}, {"/submit/../other", false, 429}} {
		r, err := send(t, newPool(t, cfg, logger), http.MethodPost, o.URL+tc.path, clientinfo.Info{Session: "s1"}, "form")
		if err != nil || r.status != tc.wantStatus || (r.upstream == "s2") != tc.retried {
			t.Errorf("POST %s: %v %+v; want %d, retried on s2: %v", tc.path, err, r, tc.wantStatus, tc.retried)
		}
	}
}

// TestBanBody: a rule's ban_body in a 200 page is a ban: the session is
// rotated and the request retried; when it is the final answer, the client
// gets the body intact, however large.
func TestBanBody(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, false)
	// The origin bans whatever IP s1 has now.
	isBad := func(ip string) bool { s, _ := fp.Session("s1"); return ip == s.ExitIP }
	banPage := "<html><title>Just a moment</title>" + strings.Repeat("z", 5000) + "cf-captcha-wall" +
		strings.Repeat("w", 200_000) + "</html>"
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		if !isBad(ip) {
			return false
		}
		if r.URL.Path == "/gz" {
			w.Header().Set("Content-Encoding", "gzip")
			zw := gzip.NewWriter(w)
			io.WriteString(zw, banPage)
			zw.Close()
			return true
		}
		io.WriteString(w, banPage)
		return true
	})
	cfg := providerConfig(fp)
	cfg.Rules = []upstream.RuleConfig{{Name: "shop", Host: "127.0.0.1", BanBody: "cf-captcha-wall", BanStatuses: []int{403}}}
	logger, _ := testLogger(t)
	p := newPool(t, cfg, logger)

	r := mustGet(t, p, o.URL+"/page", clientinfo.Info{Session: "s1"})
	if r.status != 200 || r.upstream != "s2" || r.body != exitIP(t, fp, "s2") {
		t.Fatalf("banned page not retried: %d via %s (%d bytes)", r.status, r.upstream, len(r.body))
	}
	if st := statusOf(t, p, "s1"); st.LastOutcome != "banned" || fp.Rotations("s1") != 1 {
		t.Fatalf("s1 after a ban page: %+v, %d rotations", st, fp.Rotations("s1"))
	} else if sc, ok := coolingAt(t, st, o.URL); !ok || sc.Reason != "banned" {
		t.Fatalf("s1 does not sit out the site that banned it: %+v", st)
	}

	// Final answer (no retries): the ban page reaches the client intact.
	cfg.Retry.MaxAttempts = 1
	p1 := newPool(t, cfg, logger)
	r = mustGet(t, p1, o.URL+"/page", clientinfo.Info{Session: "s1"})
	if r.body != banPage {
		t.Fatalf("final ban page altered: %d bytes, want %d", len(r.body), len(banPage))
	}
	// Compressed ban pages are recognised too, and passed on untouched.
	// (A fresh pool: p1 has s1 cooling after the ban page.)
	p1 = newPool(t, cfg, logger)
	req, _ := http.NewRequestWithContext(clientinfo.With(context.Background(), clientinfo.Info{Session: "s1"}),
		http.MethodGet, o.URL+"/gz", nil)
	req.Header.Set("Accept-Encoding", "gzip")
	resp, err := p1.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	zr, err := gzip.NewReader(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	plain, _ := io.ReadAll(zr)
	resp.Body.Close()
	if string(plain) != banPage {
		t.Fatalf("gzip ban page altered")
	}
	if st := statusOf(t, p1, "s1"); st.LastOutcome != "banned" {
		t.Fatalf("gzip ban page not detected: %+v", st)
	}
}

// TestDeadGatewayCooldown: a session whose gateway port is dead gets
// connection errors and a cooldown; traffic moves to the healthy sessions
// and no client sees an error. When every session is down, requests get
// the documented 503.
func TestDeadGatewayCooldown(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, false)
	dead := testkit.DeadAddr(t)
	logger, logs := testLogger(t)
	p := newPool(t, upstream.Config{Sessions: []upstream.SessionConfig{
		{ID: "dead", URL: "http://u:p4ss@" + dead, Weight: 10},
		{ID: "good1", URL: fp.URL("s1", "http")},
		{ID: "good2", URL: fp.URL("s2", "socks5")},
	}}, logger)
	// The first request asks for the dead session by name; the others
	// are spread by weight (and "dead" has the highest).
	if r := mustGet(t, p, o.URL, clientinfo.Info{Session: "dead"}); r.status != 200 || r.upstream == "dead" {
		t.Fatalf("request naming the dead session: %+v", r)
	}
	for i := range 30 {
		r, err := send(t, p, http.MethodGet, o.URL, clientinfo.Info{Key: fmt.Sprint("k", i)}, "")
		if err != nil || r.status != 200 {
			t.Fatalf("request %d: %v %+v", i, err, r)
		}
	}
	st := statusOf(t, p, "dead")
	if st.Available || st.CooldownReason != "connection_error" || st.Weight != 7 || st.ConsecutiveFailures != 1 {
		t.Fatalf("dead session: %+v", st)
	}
	if left := time.Until(st.CooldownUntil); left < 290*time.Second {
		t.Errorf("dead session cooldown %v, want about 300s", left)
	}
	if strings.Contains(st.LastError, "p4ss") || strings.Contains(st.Proxy, "p4ss") {
		t.Errorf("password in the status: %+v", st)
	}

	// Every session down: the first request learns it the hard way, the
	// next ones are told at once.
	p2 := newPool(t, upstream.Config{Sessions: []upstream.SessionConfig{
		{ID: "dead1", URL: "http://u:p4ss@" + dead},
		{ID: "dead2", URL: "socks5://u:p4ss@" + dead},
	}}, logger)
	for i := range 2 {
		_, err := send(t, p2, http.MethodGet, o.URL, clientinfo.Info{}, "")
		var ex *upstream.ExhaustedError
		if !errors.As(err, &ex) || ex.HTTPStatus() != 503 || !errors.Is(err, upstream.ErrExhausted) {
			t.Fatalf("request %d: err = %v, want an ExhaustedError", i, err)
		}
		if !regexp.MustCompile(`^all 2 upstream sessions are cooling down \(next ready in (5m0s|4m5\ds)\); last failure: upstream session dead\d: `).MatchString(err.Error()) &&
			!regexp.MustCompile(`^all 2 upstream sessions are cooling down \(next ready in (5m0s|4m5\ds)\)$`).MatchString(err.Error()) {
			t.Errorf("request %d: message %q", i, err)
		}
		if strings.Contains(err.Error(), "p4ss") {
			t.Errorf("password in the error: %v", err)
		}
	}
	var de *upstream.DialError
	if _, err := send(t, p2, http.MethodGet, o.URL, clientinfo.Info{}, ""); errors.As(err, &de) {
		t.Errorf("a request told 503 at once still dialed: %v", err)
	}
	if !strings.Contains(logs.String(), "all upstream sessions unavailable") {
		t.Errorf("the exhaustion is not logged")
	}

	// when_exhausted: direct sends from this host instead, and says so.
	p3 := newPool(t, upstream.Config{WhenExhausted: "direct", Sessions: []upstream.SessionConfig{
		{ID: "dead1", URL: "http://u:p@" + dead},
	}}, logger)
	send(t, p3, http.MethodGet, o.URL, clientinfo.Info{}, "") // puts dead1 in cooldown
	r := mustGet(t, p3, o.URL, clientinfo.Info{})
	if r.status != 200 || r.upstream != "direct" || r.body != "127.0.0.1" {
		t.Fatalf("direct fallback: %+v", r)
	}
	if !strings.Contains(logs.String(), "sending requests DIRECT") {
		t.Errorf("the direct fallback is not logged loudly")
	}
}

// TestGatewayFailuresAreRetriedElsewhere: a gateway that answers CONNECT
// with 429 or 502, or hangs, costs the client nothing.
func TestGatewayFailuresAreRetriedElsewhere(t *testing.T) {
	bothWays(t, testGatewayFailuresAreRetriedElsewhere)
}

func testGatewayFailuresAreRetriedElsewhere(t *testing.T, c client) {
	for _, tc := range []struct {
		mode    fakeprovider.Mode
		outcome string
	}{
		{fakeprovider.Mode429, "rate_limited"},
		{fakeprovider.Mode502, "connection_error"},
		{fakeprovider.ModeRefuse, "connection_error"},
		{fakeprovider.ModeHang, "connection_error"},
	} {
		t.Run(tc.outcome+fmt.Sprint(tc.mode), func(t *testing.T) {
			fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
			o := newOrigin(t, true)
			cfg := providerConfig(fp)
			cfg.CAFiles = []string{originCAFile(t, o.Server)}
			cfg.DialTimeout = 300 * time.Millisecond
			logger, _ := testLogger(t)
			p := newPool(t, cfg, logger)
			fp.SetMode("s1", tc.mode)
			start := time.Now()
			r := c.mustGet(t, p, o.URL, clientinfo.Info{Session: "s1"})
			if r.status != 200 || r.upstream != "s2" {
				t.Fatalf("got %+v, want 200 via s2", r)
			}
			if d := time.Since(start); d > 3*time.Second {
				t.Errorf("took %v", d)
			}
			if st := statusOf(t, p, "s1"); st.LastOutcome != tc.outcome || st.Available {
				t.Errorf("s1: %+v, want %s and cooling", st, tc.outcome)
			}
			c.mirrored(t, p)
		})
	}
}

func TestProviderDownAtStart(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, false)

	t.Run("static sessions still serve", func(t *testing.T) {
		logger, logs := testLogger(t)
		p := newPool(t, upstream.Config{
			Provider: upstream.ProviderConfig{API: "http://" + testkit.DeadAddr(t), APIKey: "s3cr3t-api-key"},
			Sessions: []upstream.SessionConfig{{ID: "mine", URL: fp.URL("s1", "http")}},
		}, logger)
		if r := mustGet(t, p, o.URL, clientinfo.Info{}); r.upstream != "mine" {
			t.Fatalf("got %+v", r)
		}
		l := logs.String()
		if !strings.Contains(l, "provider API failed at start-up") || !strings.Contains(l, "connection refused") {
			t.Errorf("the log does not say why:\n%s", l)
		}
		if strings.Contains(l, "s3cr3t-api-key") {
			t.Errorf("API key in the log")
		}
		if ps := upstream.RefreshOf(p); ps.LastError == "" || ps.Failures != 1 {
			t.Errorf("provider status %+v", ps)
		}
	})

	t.Run("provider only: 503 until a refresh succeeds", func(t *testing.T) {
		fp.SetAPIMode(fakeprovider.API500)
		defer fp.SetAPIMode(fakeprovider.APIOK)
		cfg := providerConfig(fp)
		cfg.Provider.Refresh = 50 * time.Millisecond
		logger, logs := testLogger(t)
		p := newPool(t, cfg, logger)
		_, err := send(t, p, http.MethodGet, o.URL, clientinfo.Info{}, "")
		var ex *upstream.ExhaustedError
		if !errors.As(err, &ex) || ex.HTTPStatus() != 503 ||
			!strings.HasPrefix(err.Error(), "no upstream sessions yet: provider API GET ") || !strings.Contains(err.Error(), "500") {
			t.Fatalf("err = %v", err)
		}
		if !strings.Contains(logs.String(), "only source of sessions") {
			t.Errorf("the log does not say the pool has nothing")
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error)
		go func() { done <- p.Run(ctx) }()
		fp.SetAPIMode(fakeprovider.APIOK)
		testkit.Eventually(t, testkit.Patience, func() bool { return len(p.Sessions()) == 2 }, "a refresh")
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("Run: %v", err)
		}
		if r := mustGet(t, p, o.URL, clientinfo.Info{}); r.status != 200 {
			t.Fatalf("after the refresh: %+v", r)
		}
		if !strings.Contains(logs.String(), "provider API answering again") {
			t.Errorf("recovery not logged")
		}
	})
}

// TestProviderGarbageKeepsLastList: whatever the API answers, a bad list
// never replaces a good one, and the reason is reported.
func TestProviderGarbageKeepsLastList(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2, APIKey: "k-9f8e7d"})
	o := newOrigin(t, false)
	cfg := providerConfig(fp)
	cfg.Provider.Timeout = 300 * time.Millisecond
	logger, logs := testLogger(t)
	p := newPool(t, cfg, logger)
	if len(p.Sessions()) != 2 {
		t.Fatalf("start: %d sessions", len(p.Sessions()))
	}
	ctx := context.Background()
	for _, tc := range []struct {
		mode fakeprovider.APIMode
		want string
	}{
		{fakeprovider.APIGarbage, "not the session list JSON"},
		{fakeprovider.APIEmpty, "no sessions in the answer"},
		{fakeprovider.API500, "500 Internal Server Error"},
		{fakeprovider.APIHang, "Client.Timeout"},
	} {
		fp.SetAPIMode(tc.mode)
		err := upstream.RefreshNow(ctx, p)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("mode %d: err = %v, want %q", tc.mode, err, tc.want)
		}
		if err != nil && strings.Contains(err.Error(), "k-9f8e7d") {
			t.Errorf("API key in the error: %v", err)
		}
		if n := len(p.Sessions()); n != 2 {
			t.Fatalf("mode %d: %d sessions left, want the last good 2", tc.mode, n)
		}
		if r := mustGet(t, p, o.URL, clientinfo.Info{}); r.status != 200 {
			t.Fatalf("mode %d: request failed: %+v", tc.mode, r)
		}
	}
	if ps := upstream.RefreshOf(p); !strings.Contains(ps.LastError, "Client.Timeout") || ps.Failures != 4 {
		t.Errorf("provider status %+v", ps)
	}
	// Wrong key: 401, reported.
	fp.SetAPIMode(fakeprovider.APIOK)
	bad := providerConfig(fp)
	bad.Provider.APIKey = "wrong-key-123"
	pb := newPool(t, bad, logger)
	if ps := upstream.RefreshOf(pb); !strings.Contains(ps.LastError, "401") || strings.Contains(ps.LastError, "wrong-key-123") {
		t.Errorf("bad key status: %+v", ps)
	}

	// Recovery: a new session appears, a removed one goes, health stays.
	p.Sessions()
	mustGet(t, p, o.URL, clientinfo.Info{Session: "s1"})
	w1 := statusOf(t, p, "s1").Weight
	fp.AddSession(fakeprovider.Sticky, 0)
	fp.RemoveSession("s2")
	if err := upstream.RefreshNow(ctx, p); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, s := range p.Sessions() {
		ids = append(ids, s.ID)
	}
	if strings.Join(ids, ",") != "s1,s3" {
		t.Fatalf("sessions after refresh: %v", ids)
	}
	if w := statusOf(t, p, "s1").Weight; w != w1 {
		t.Errorf("s1 lost its health across a refresh: weight %d, was %d", w, w1)
	}
	if r := mustGet(t, p, o.URL, clientinfo.Info{Session: "s3"}); r.upstream != "s3" || r.body != exitIP(t, fp, "s3") {
		t.Fatalf("new session: %+v", r)
	}
	if strings.Contains(logs.String(), "k-9f8e7d") {
		t.Errorf("API key in the log")
	}
}

func TestDialContextThroughSession(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, false)
	logger, _ := testLogger(t)
	for _, proto := range []string{"http", "socks5"} {
		cfg := providerConfig(fp)
		cfg.Provider.Protocol = proto
		cfg.Sessions = []upstream.SessionConfig{{ID: "dead", URL: "http://u:p@" + testkit.DeadAddr(t), Weight: 10}}
		p := newPool(t, cfg, logger)
		for _, id := range []string{"s2", "dead"} {
			ctx, cancel := context.WithTimeout(clientinfo.With(context.Background(), clientinfo.Info{Session: id}), 5*time.Second)
			c, err := p.DialContext(ctx, "tcp", o.Listener.Addr().String())
			cancel()
			if err != nil {
				t.Fatalf("%s %s: %v", proto, id, err)
			}
			fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			c.Close()
			if id == "s2" && string(b) != exitIP(t, fp, "s2") {
				t.Fatalf("%s: tunnel left from %s, want s2's %s", proto, b, exitIP(t, fp, "s2"))
			}
		}
		// The hint naming the dead session moved on, and marked it.
		if st := statusOf(t, p, "dead"); st.LastOutcome != "connection_error" || st.Available {
			t.Fatalf("%s: dead session %+v", proto, st)
		}
	}
}

func TestSessionHeaderNeverForwarded(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{})
	o := newOrigin(t, false)
	var leaked atomic.Bool
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		leaked.Store(leaked.Load() || r.Header.Get("X-Onceproxy-Session") != "")
		return false
	})
	logger, _ := testLogger(t)
	for _, cfg := range []upstream.Config{{}, providerConfig(fp)} {
		p := newPool(t, cfg, logger)
		req, _ := http.NewRequest(http.MethodGet, o.URL, nil)
		req.Header.Set("X-Onceproxy-Session", "abc")
		resp, err := p.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if req.Header.Get("X-Onceproxy-Session") != "abc" {
			t.Error("the caller's request was modified")
		}
		if resp.Header.Get(upstream.HeaderUpstream) == "" {
			t.Error("no X-Onceproxy-Upstream")
		}
	}
	if leaked.Load() {
		t.Fatal("X-Onceproxy-Session reached the origin")
	}
}

// TestBindingKeepsALogicalRequestOnItsSession: a request retried or
// re-queued by the client (same dedup key) goes back to the session it
// succeeded on.
func TestBindingKeepsALogicalRequestOnItsSession(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 5})
	o := newOrigin(t, false)
	logger, _ := testLogger(t)
	p := newPool(t, providerConfig(fp), logger)
	for k := range 10 {
		info := clientinfo.Info{Key: fmt.Sprint("v1:key", k)}
		first := mustGet(t, p, o.URL, info).upstream
		for range 5 {
			if got := mustGet(t, p, o.URL, info).upstream; got != first {
				t.Fatalf("key %d moved from %s to %s", k, first, got)
			}
		}
	}
}

func TestRuleStickyBuckets(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 6})
	o := newOrigin(t, false)
	cfg := providerConfig(fp)
	cfg.Rules = []upstream.RuleConfig{
		{Name: "api", Host: "127.0.0.1", PathPrefix: "/api/", Sticky: "account_rule"},
		{Host: "127.0.0.1", Sticky: "host"},
	}
	logger, _ := testLogger(t)
	p := newPool(t, cfg, logger)
	// sticky: host — every request to the host, whatever the client,
	// leaves through one session.
	var first string
	for i := range 10 {
		r := mustGet(t, p, o.URL+"/page", clientinfo.Info{Account: fmt.Sprint("acct", i)})
		if first == "" {
			first = r.upstream
		}
		if r.upstream != first {
			t.Fatalf("sticky host moved: %s then %s", first, r.upstream)
		}
	}
	// sticky: account_rule — one session per account for this rule, and
	// accounts spread.
	per := map[string]string{}
	used := map[string]bool{}
	for range 3 {
		for i := range 12 {
			acct := fmt.Sprint("acct", i)
			r := mustGet(t, p, o.URL+"/api/x", clientinfo.Info{Account: acct})
			if prev, ok := per[acct]; ok && prev != r.upstream {
				t.Fatalf("account %s moved from %s to %s", acct, prev, r.upstream)
			}
			per[acct] = r.upstream
			used[r.upstream] = true
		}
	}
	if len(used) < 3 {
		t.Errorf("12 accounts used only %v", used)
	}
}

func TestCanceledRequestIsNotHeldAgainstTheSession(t *testing.T) {
	bothWays(t, testCanceledRequestIsNotHeldAgainstTheSession)
}

func testCanceledRequestIsNotHeldAgainstTheSession(t *testing.T, c client) {
	fp := fakeprovider.Start(t, fakeprovider.Options{})
	o := newOrigin(t, c.fp != nil)
	entered := make(chan struct{}, 1)
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		entered <- struct{}{}
		<-r.Context().Done()
		return true
	})
	logger, _ := testLogger(t)
	cfg := providerConfig(fp)
	if c.fp != nil {
		cfg.CAFiles = []string{originCAFile(t, o.Server)}
	}
	p := newPool(t, cfg, logger)
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, o.URL, nil)
	req = c.request(req)
	go func() {
		<-entered
		cancel()
	}()
	if _, err := p.RoundTrip(req); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	if st := statusOf(t, p, "s1"); st.Failures != 0 || !st.Available || st.Weight != 5 {
		t.Fatalf("a canceled request counted against the session: %+v", st)
	}
}

func TestAdminRotateErrors(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{})
	logger, _ := testLogger(t)
	p := newPool(t, providerConfig(fp), logger)
	var hs interface{ HTTPStatus() int }
	if err := p.Rotate(context.Background(), "nope"); !errors.As(err, &hs) || hs.HTTPStatus() != 404 {
		t.Fatalf("unknown id: %v", err)
	}
	static := newPool(t, upstream.Config{URL: fp.URL("s1", "http")}, logger)
	if err := static.Rotate(context.Background(), "default"); !errors.As(err, &hs) || hs.HTTPStatus() != 409 {
		t.Fatalf("no provider: %v", err)
	}
	fp.SetAPIMode(fakeprovider.API500)
	if err := p.Rotate(context.Background(), "s1"); !errors.As(err, &hs) || hs.HTTPStatus() != 502 {
		t.Fatalf("provider failing: %v", err)
	}
	fp.SetAPIMode(fakeprovider.APIOK)
	fp.RemoveSession("s1")
	if err := p.Rotate(context.Background(), "s1"); !errors.As(err, &hs) || hs.HTTPStatus() != 404 {
		t.Fatalf("provider no longer knows the id: %v", err)
	}
}

// TestSecretsNeverShown: the API key and session passwords appear in no
// log line, error, status or description, nor do the gateways' user
// names: some providers put the account's token there (ZenRows-style
// http://TOKEN:@gw, ScrapingBee-style http://KEY:options@gw), and the
// status page and GET /upstream/sessions showed it in clear.
func TestSecretsNeverShown(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2, APIKey: "APIKEY-7c1d"})
	o := newOrigin(t, false)
	cfg := providerConfig(fp)
	cfg.URL = "http://TOKENUSER-5b8e:STATICPASS@" + testkit.DeadAddr(t)
	cfg.Health.URL = o.URL
	cfg.Health.Interval = 20 * time.Millisecond
	logger, logs := testLogger(t)
	p := newPool(t, cfg, logger)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- p.Run(ctx) }()
	testkit.Eventually(t, testkit.Patience, func() bool { return statusOf(t, p, "default").LastOutcome != "" }, "a health round")
	cancel()
	<-done
	for i := range 4 {
		send(t, p, http.MethodGet, o.URL, clientinfo.Info{Key: fmt.Sprint(i)}, "")
	}
	p.Rotate(context.Background(), "s1")
	js, _ := json.Marshal(p.Sessions())
	ps, _ := json.Marshal(p.Providers())
	secrets := []string{"APIKEY-7c1d", "STATICPASS", "TOKENUSER-5b8e"}
	for _, s := range fp.Sessions() {
		secrets = append(secrets, s.Password, s.Username)
	}
	// A pool of one session describes it by its gateway's URL.
	one, err := upstream.New(upstream.Config{URL: "http://TOKENUSER-5b8e:@" + testkit.DeadAddr(t)}, logger)
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	for _, where := range []struct{ name, text string }{
		{"log", logs.String()}, {"sessions", string(js)}, {"provider status", string(ps)}, {"describe", p.Describe()},
		{"describe of one session", one.Describe()},
	} {
		for _, s := range secrets {
			if strings.Contains(where.text, s) {
				t.Errorf("%s contains secret %q:\n%s", where.name, s, where.text)
			}
		}
	}
}

// TestHealthChecks: probes through every session mark them; a session
// whose gateway refuses goes into cooldown, and a later good probe brings
// it back. An IP-echo health URL tells the exit IP of static sessions.
func TestHealthChecks(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, false)
	cfg := upstream.Config{
		Sessions: []upstream.SessionConfig{{ID: "a", URL: fp.URL("s1", "http")}, {ID: "b", URL: fp.URL("s2", "socks5")}},
		Health:   upstream.HealthConfig{URL: o.URL + "/ip", Interval: 20 * time.Millisecond, Timeout: time.Second},
	}
	logger, _ := testLogger(t)
	p := newPool(t, cfg, logger)
	fp.SetMode("s2", fakeprovider.ModeRefuse)
	runPool(t, p)
	testkit.Eventually(t, testkit.Patience, func() bool {
		st := statusOf(t, p, "b")
		return !st.Available && st.LastOutcome == "connection_error"
	}, "b marked by a probe")
	testkit.Eventually(t, testkit.Patience, func() bool { return statusOf(t, p, "a").ExitIP == exitIP(t, fp, "s1") }, "a's exit IP from the probe")
	fp.SetMode("s2", fakeprovider.ModeOK)
	testkit.Eventually(t, testkit.Patience, func() bool { return statusOf(t, p, "b").Available }, "b back after a good probe")
	if st := statusOf(t, p, "b"); st.ExitIP != exitIP(t, fp, "s2") {
		t.Errorf("b exit IP %q, want %s", st.ExitIP, exitIP(t, fp, "s2"))
	}
}

func TestTimedRotationMin(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 1, Rotation: fakeprovider.Timed, Interval: 10 * time.Minute})
	logger, _ := testLogger(t)
	cfg := providerConfig(fp)
	cfg.Sessions = []upstream.SessionConfig{
		{ID: "t1", URL: fp.URL("s1", "http"), Rotation: "timed", Interval: 30 * time.Second},
		{ID: "st", URL: fp.URL("s1", "http")},
	}
	p := newPool(t, cfg, logger)
	if d, ok := p.TimedRotationMin(); !ok || d != 30*time.Second {
		t.Fatalf("TimedRotationMin = %v %v, want 30s", d, ok)
	}
	if st := statusOf(t, p, "s1"); st.Rotation != "timed" || st.Interval != "10m0s" {
		t.Fatalf("provider timed session: %+v", st)
	}
	none := newPool(t, upstream.Config{URL: fp.URL("s1", "http")}, logger)
	if _, ok := none.TimedRotationMin(); ok {
		t.Fatal("TimedRotationMin without timed sessions")
	}
}

func TestDescribe(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 3})
	logger, _ := testLogger(t)
	direct := newPool(t, upstream.Config{}, logger)
	if d := direct.Describe(); d != "direct" {
		t.Errorf("Describe() = %q", d)
	}
	p := newPool(t, providerConfig(fp), logger)
	if d := p.Describe(); !strings.Contains(d, "3 upstream sessions [s1 s2 s3]") || !strings.Contains(d, fp.APIURL()) {
		t.Errorf("Describe() = %q", d)
	}
}

// TestPerRequestRetriesOnItself: a per_request session's next connection
// has a new exit IP, so a 429 is retried on it without any rotation call.
func TestPerRequestRetriesOnItself(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Rotation: fakeprovider.PerRequest})
	o := newOrigin(t, false)
	var first atomic.Value
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		if first.CompareAndSwap(nil, ip) || first.Load() == ip {
			http.Error(w, "slow down", http.StatusTooManyRequests)
			return true
		}
		return false
	})
	logger, _ := testLogger(t)
	p := newPool(t, providerConfig(fp), logger)
	calls := fp.APICalls()
	r := mustGet(t, p, o.URL, clientinfo.Info{})
	if r.status != 200 || r.upstream != "s1" || r.body == first.Load() {
		t.Fatalf("got %+v, want 200 from s1's next IP", r)
	}
	if fp.APICalls() != calls || fp.Rotations("s1") != 0 {
		t.Fatalf("a per_request session was rotated through the API")
	}
}

// TestConfiguredProxyNextToProviderIsNotRotated: a plain proxy in the
// config, next to a provider that does not know it, is asked for once.
func TestConfiguredProxyNextToProviderIsNotRotated(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 1})
	o := newOrigin(t, false)
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		if ip == exitIP(t, fp, "s1") {
			return false
		}
		http.Error(w, "slow down", http.StatusTooManyRequests)
		return true
	})
	// Both fakes hand out 127.0.0.2 first: use the other's second session
	// so the origin can tell them apart.
	other := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	cfg := providerConfig(fp)
	cfg.Sessions = []upstream.SessionConfig{{ID: "plain", URL: other.URL("s2", "http")}}
	logger, _ := testLogger(t)
	p := newPool(t, cfg, logger)
	var skew atomic.Int64
	upstream.SetClock(p, func() time.Time { return time.Now().Add(time.Duration(skew.Load())) })
	calls := fp.APICalls()
	for range 3 {
		// plain: 429, rotation asked (the first time only), retried on s1.
		if r := mustGet(t, p, o.URL, clientinfo.Info{Session: "plain"}); r.status != 200 || r.upstream != "s1" {
			t.Fatalf("got %+v", r)
		}
		skew.Add(int64(2 * time.Minute)) // past plain's cooldown
	}
	if n := fp.APICalls() - calls; n != 1 {
		t.Fatalf("%d rotate calls for a session the provider does not know, want 1", n)
	}
}

// TestUpgradeIsNotReadAhead: a 101 answer's body is the live connection;
// a ban_body rule must not read it ahead or wrap it.
func TestUpgradeIsNotReadAhead(t *testing.T) {
	// A client's fingerprint or not: a protocol switch goes out the
	// net/http way, which splices the switched connection.
	bothWays(t, testUpgradeIsNotReadAhead)
}

func testUpgradeIsNotReadAhead(t *testing.T, c client) {
	fp := fakeprovider.Start(t, fakeprovider.Options{})
	// TLS: through a CONNECT tunnel (the fake gateway does not relay
	// upgrades in absolute form).
	o := newOrigin(t, true)
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return true
		}
		defer c.Close()
		io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
		line, _ := brw.ReadString('\n')
		io.WriteString(c, "echo "+line)
		return true
	})
	cfg := providerConfig(fp)
	cfg.CAFiles = []string{originCAFile(t, o.Server)}
	cfg.Rules = []upstream.RuleConfig{{BanBody: "captcha"}}
	logger, _ := testLogger(t)
	p := newPool(t, cfg, logger)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, o.URL, nil)
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", "echo")
	resp, err := p.RoundTrip(c.request(req))
	if err != nil {
		t.Fatal(err)
	}
	rw, ok := resp.Body.(io.ReadWriteCloser)
	if resp.StatusCode != 101 || !ok {
		t.Fatalf("status %d, body %T: want 101 with a ReadWriteCloser", resp.StatusCode, resp.Body)
	}
	defer rw.Close()
	io.WriteString(rw, "ping\n")
	line, err := bufio.NewReader(rw).ReadString('\n')
	if err != nil || line != "echo ping\n" {
		t.Fatalf("upgraded stream: %q %v", line, err)
	}
	if n := p.HelloCounts(); n["mirrored"] != 0 || n["go"] != 1 {
		t.Errorf("upstream connections by hello %v, want one go", n)
	}
}

// TestServerErrorRetriedElsewhere: a 5xx costs the session 1 weight and no
// cooldown, is retried on another session, and rotates nothing.
func TestServerErrorRetriedElsewhere(t *testing.T) {
	bothWays(t, testServerErrorRetriedElsewhere)
}

func testServerErrorRetriedElsewhere(t *testing.T, c client) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, c.fp != nil)
	bad := exitIP(t, fp, "s1")
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		if ip != bad {
			return false
		}
		http.Error(w, "oops", http.StatusBadGateway)
		return true
	})
	logger, _ := testLogger(t)
	cfg := providerConfig(fp)
	if c.fp != nil {
		cfg.CAFiles = []string{originCAFile(t, o.Server)}
	}
	p := newPool(t, cfg, logger)
	r := c.mustGet(t, p, o.URL, clientinfo.Info{Session: "s1"})
	if r.status != 200 || r.upstream != "s2" {
		t.Fatalf("got %+v, want 200 via s2", r)
	}
	st := statusOf(t, p, "s1")
	if st.Weight != 4 || !st.Available || st.LastOutcome != "server_error" || st.ConsecutiveFailures != 0 || fp.Rotations("s1") != 0 {
		t.Fatalf("s1 after a 502: %+v, %d rotations", st, fp.Rotations("s1"))
	}
	c.mirrored(t, p)
}

// runPool runs p's background work (provider refreshes, health rounds)
// until the test ends.
func runPool(t *testing.T, p *upstream.Pool) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}
