package admin_test

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/base64"
	"html"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/capture"
	"github.com/seed-a3c387e8/onceproxy/mitm"
	"github.com/seed-a3c387e8/onceproxy/proxy/admin"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

func TestAdminToken(t *testing.T) {
	admin := httptest.NewServer(admin.New(admin.Options{
		CAPEM:   []byte("PEM"),
		Token:   "s3cret-token",
		Metrics: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "metrics") }),
	}))
	defer admin.Close()
	get := func(path, auth string) int {
		req, _ := http.NewRequest(http.MethodGet, admin.URL+path, nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, tc := range []struct {
		path, auth string
		want       int
	}{
		{"/health", "", 200},
		{"/ca.pem", "", 200},
		{"/metrics", "", 401},
		{"/metrics", "Bearer wrong", 401},
		{"/metrics", "Basic s3cret-token", 401},
		{"/metrics", "Bearer s3cret-token", 200},
		{"/nope", "Bearer s3cret-token", 404},
	} {
		if got := get(tc.path, tc.auth); got != tc.want {
			t.Errorf("GET %s with %q: %d, want %d", tc.path, tc.auth, got, tc.want)
		}
	}
	resp, _ := http.Get(admin.URL + "/metrics")
	if !strings.Contains(resp.Header.Get("WWW-Authenticate"), "Bearer") {
		t.Error("401 without a Bearer challenge")
	}
	resp.Body.Close()
}

// TestStatusPage renders the page from a real engine (one MISS, one HIT),
// a real CA and a real upstream pool whose only session is cooling down
// after its gateway refused a connection.
func TestStatusPage(t *testing.T) {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "page") }))
	defer origin.Close()
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	ca, err := mitm.LoadOrCreate(mitm.Config{CADir: t.TempDir()}, logger)
	if err != nil {
		t.Fatal(err)
	}
	defer ca.Close()
	store := dedup.NewMemoryStore(1 << 20)
	defer store.Close()
	engine, err := dedup.New(dedup.Config{Enabled: true, TTL: time.Minute}, dedup.Options{Store: store, Next: http.DefaultTransport, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	defer engine.Close()
	for range 2 {
		req, _ := http.NewRequest(http.MethodGet, origin.URL+"/a", nil)
		resp, err := engine.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		// The body streams: read to its end, the response is cached.
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	pool, err := upstream.New(upstream.Config{Sessions: []upstream.SessionConfig{{ID: "s1", URL: "http://tok3n-user:pw@" + deadAddr(t)}}}, logger)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	req, _ := http.NewRequest(http.MethodGet, origin.URL+"/b", nil)
	if _, err := pool.RoundTrip(req); err == nil {
		t.Fatal("a request through a dead gateway succeeded")
	}

	tally := fingerprint.NewTally(8)
	hello := goHello(t)
	for range 3 {
		tally.Add(fingerprint.New(hello, nil), time.Now())
	}
	srv := httptest.NewServer(admin.New(admin.Options{CAPEM: ca.CertPEM(), Cache: engine, Sessions: pool, Fingerprints: tallySource{tally}}))
	defer srv.Close()
	page, resp := statusPage(t, srv.URL)
	sum := sha256.Sum256(ca.Certificate().RawSubjectPublicKeyInfo)
	for _, want := range []string{
		`<b id="savings">50%</b>`, `<b id="hit">1</b>`, `<b id="miss">1</b>`, "<td>s1</td>", "cooling 5m",
		`<h3 id="provider-sessions">sessions`, "unavailable: ", "0/1 ready",
		base64.StdEncoding.EncodeToString(sum[:]), `href="/ca.pem"`,
		"<td><code>" + hello.JA4() + "</code></td><td>h1</td><td><code></code></td><td>3</td>",
	} {
		if !strings.Contains(page, want) {
			t.Errorf("status page lacks %q", want)
		}
	}
	if strings.Contains(page, "pw@") {
		t.Error("status page shows a gateway password")
	}
	// Some providers put the account's token in the user name.
	if strings.Contains(page, "tok3n-user") {
		t.Error("status page shows a gateway user name")
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/html") {
		t.Errorf("Content-Type %q", ct)
	}
	if resp, _ := http.Get(srv.URL + "/nope"); resp.StatusCode != 404 {
		t.Errorf("unknown path: %d", resp.StatusCode)
	}
}

// tallySource shows a tally's fingerprints, as the proxy server does.
type tallySource struct{ t *fingerprint.Tally }

func (s tallySource) ClientFingerprints() []fingerprint.Seen { return s.t.Top(20) }

// goHello is the ClientHello of Go's TLS client, as the proxy captures it.
func goHello(t *testing.T) *fingerprint.ClientHello {
	t.Helper()
	cli, srv := net.Pipe()
	go func() {
		tls.Client(cli, &tls.Config{ServerName: "example.com"}).Handshake() // fails once srv closes
		cli.Close()
	}()
	_, h, err := capture.PeekClientHello(srv)
	srv.Close()
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// deadAddr is a loopback address nothing listens on.
func deadAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// TestPprofOnlyWhenAsked: /debug/pprof/ is served with Options.Pprof, and
// behind the token like every private endpoint; without it, 404.
func TestPprofOnlyWhenAsked(t *testing.T) {
	off := httptest.NewServer(admin.New(admin.Options{}))
	defer off.Close()
	on := httptest.NewServer(admin.New(admin.Options{Pprof: true, Token: "tok"}))
	defer on.Close()
	get := func(base, auth string) int {
		req, _ := http.NewRequest(http.MethodGet, base+"/debug/pprof/", nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if c := get(off.URL, ""); c != 404 {
		t.Errorf("pprof off: %d, want 404", c)
	}
	if c := get(on.URL, ""); c != 401 {
		t.Errorf("pprof on, no token: %d, want 401", c)
	}
	if c := get(on.URL, "Bearer tok"); c != 200 {
		t.Errorf("pprof on, with the token: %d, want 200", c)
	}
}

// sharingCache is a Cache whose flights are handing their answers to the
// fleet's store: the status page says how many.
type sharingCache struct{}

func (sharingCache) Stats() dedup.Stats {
	return dedup.Stats{Flights: 3, Waiters: 5, Sharing: 2, XCache: map[string]uint64{}}
}
func (sharingCache) InvalidateURL(context.Context, string) (int, error) { return 0, nil }
func (sharingCache) InvalidateKey(context.Context, string) error        { return nil }

// TestStatusPageShowsSharingFlights: flights whose clients have their
// answer while the fleet's store takes it are counted among the running
// ones, so that a store falling behind shows.
func TestStatusPageShowsSharingFlights(t *testing.T) {
	srv := httptest.NewServer(admin.New(admin.Options{Cache: sharingCache{}}))
	defer srv.Close()
	want := "flights running: 3 (2 handing their answer to the fleet's store), clients waiting on them: 5"
	if page, _ := statusPage(t, srv.URL); !strings.Contains(page, want) {
		t.Errorf("status page lacks %q:\n%s", want, page)
	}
}

// statusPage gets the admin server's status page at base, as a reader
// would copy it: html/template escapes '+' and quotes in text.
func statusPage(t *testing.T, base string) (string, *http.Response) {
	t.Helper()
	resp, err := http.Get(base + "/")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return html.UnescapeString(string(b)), resp
}

// downFleet is a shared store whose breaker is open: every command fails
// at once.
type downFleet struct{}

func (downFleet) Name() string    { return "redis" }
func (downFleet) Available() bool { return false }
func (downFleet) FleetStats(context.Context) (dedup.FleetStats, error) {
	return dedup.FleetStats{}, dedup.ErrUnavailable
}

// TestStatusPageSaysTheStoreIsDown: the status page named the fleet's
// store only when it could read the fleet's statistics from it, so with
// the store down (the moment an operator opens the page to see why) it
// said nothing about a store at all, as if the instance ran alone.
func TestStatusPageSaysTheStoreIsDown(t *testing.T) {
	srv := httptest.NewServer(admin.New(admin.Options{Cache: sharingCache{}, Fleet: downFleet{}}))
	defer srv.Close()
	page, _ := statusPage(t, srv.URL)
	if !strings.Contains(page, "redis") || !strings.Contains(page, "unavailable") {
		t.Errorf("status page with the fleet's store down does not say so:\n%s", page)
	}
}
