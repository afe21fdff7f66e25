package upstream_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// twoProviders starts a primary (priority 10, 2 sessions, exit IPs
// 127.0.0.2-19) and a secondary (priority 5, 2 sessions, 127.0.0.20-39)
// on loopback, and the config naming both.
func twoProviders(t *testing.T, po, so fakeprovider.Options) (pri, sec *fakeprovider.Provider, cfg upstream.Config) {
	t.Helper()
	if po.Sessions == 0 {
		po.Sessions = 2
	}
	if so.Sessions == 0 {
		so.Sessions = 2
	}
	po.ExitIPs, so.ExitIPs = [2]byte{2, 19}, [2]byte{20, 39}
	pri, sec = fakeprovider.Start(t, po), fakeprovider.Start(t, so)
	gb, req := 8.0, 0.5
	cfg = upstream.Config{Providers: []upstream.ProviderConfig{
		{Name: "primary", API: pri.APIURL(), APIKey: pri.APIKey(), Priority: 10, PricePerGB: &gb, PricePer1000Requests: &req},
		{Name: "secondary", API: sec.APIURL(), APIKey: sec.APIKey(), Priority: 5},
	}}
	return pri, sec, cfg
}

func provider(t *testing.T, p *upstream.Pool, name string) upstream.ProviderStatus {
	t.Helper()
	for _, ps := range p.Providers() {
		if ps.Name == name {
			return ps
		}
	}
	t.Fatalf("no provider %s in %+v", name, p.Providers())
	return upstream.ProviderStatus{}
}

func TestProvidersFailoverAndFailback(t *testing.T) {
	pri, _, cfg := twoProviders(t, fakeprovider.Options{}, fakeprovider.Options{})
	o := newOrigin(t, false)
	logger, logs := testLogger(t)
	p := newPool(t, cfg, logger)

	// Primary healthy: every request leaves through it.
	for i := range 20 {
		r := mustGet(t, p, o.URL, clientinfo.Info{Key: string(rune('a' + i))})
		if r.status != 200 || !strings.HasPrefix(r.upstream, "primary.") {
			t.Fatalf("request %d went through %q (%d), want the primary", i, r.upstream, r.status)
		}
	}
	if got := p.PriceOf("primary.s1"); got != (dedup.Price{PerGB: 8, Per1000Requests: 0.5}) {
		t.Errorf("primary's price %+v", got)
	}

	// Every primary session answers 429 at the gateway: the request fails
	// over inside one RoundTrip, no error reaches the caller.
	pri.SetMode("s1", fakeprovider.Mode429)
	pri.SetMode("s2", fakeprovider.Mode429)
	r := mustGet(t, p, o.URL, clientinfo.Info{})
	if r.status != 200 || !strings.HasPrefix(r.upstream, "secondary.") {
		t.Fatalf("with the primary rate-limited: %d via %q, want 200 via the secondary", r.status, r.upstream)
	}
	if ps := provider(t, p, "primary"); ps.Available || ps.Failovers != 1 || !strings.Contains(ps.Reason, "cooling") {
		t.Fatalf("primary after its sessions cooled: %+v", ps)
	}
	for range 5 {
		if r := mustGet(t, p, o.URL, clientinfo.Info{}); !strings.HasPrefix(r.upstream, "secondary.") {
			t.Fatalf("request went to %q while the primary cools", r.upstream)
		}
	}
	if n := strings.Count(logs.String(), "upstream provider unavailable: failing over"); n != 1 {
		t.Errorf("failover logged %d times, want once", n)
	}
	if got := p.PriceOf("secondary.s1"); got != (dedup.Price{}) {
		t.Errorf("secondary without prices of its own: %+v, want the savings section's (zero)", got)
	}

	// Primary back (its cooldowns end): failback, logged and counted once.
	pri.SetMode("s1", fakeprovider.ModeOK)
	pri.SetMode("s2", fakeprovider.ModeOK)
	later := time.Now().Add(2 * time.Hour)
	upstream.SetClock(p, func() time.Time { return later })
	upstream.CheckProviders(p)
	if r := mustGet(t, p, o.URL, clientinfo.Info{}); !strings.HasPrefix(r.upstream, "primary.") {
		t.Fatalf("after the primary recovered: via %q", r.upstream)
	}
	if ps := provider(t, p, "primary"); !ps.Available || ps.Failbacks != 1 {
		t.Fatalf("primary after recovery: %+v", ps)
	}
	if n := strings.Count(logs.String(), "upstream provider available again: failing back"); n != 1 {
		t.Errorf("failback logged %d times, want once", n)
	}
}

// TestProviderAPIDownAtStart: the primary's API is down when the pool
// starts: the secondary serves the first request; the primary takes over
// once a refresh gets its list.
func TestProviderAPIDownAtStart(t *testing.T) {
	pri, _, cfg := twoProviders(t, fakeprovider.Options{}, fakeprovider.Options{})
	o := newOrigin(t, false)
	logger, _ := testLogger(t)
	pri.SetAPIMode(fakeprovider.API500)
	p := newPool(t, cfg, logger)
	if r := mustGet(t, p, o.URL, clientinfo.Info{}); r.status != 200 || !strings.HasPrefix(r.upstream, "secondary.") {
		t.Fatalf("primary API down at start: %d via %q", r.status, r.upstream)
	}
	if ps := provider(t, p, "primary"); ps.Available || ps.Sessions != 0 || ps.Refresh == nil || ps.Refresh.LastError == "" {
		t.Fatalf("primary: %+v", ps)
	}
	pri.SetAPIMode(fakeprovider.APIOK)
	if err := upstream.RefreshNow(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	if r := mustGet(t, p, o.URL, clientinfo.Info{}); !strings.HasPrefix(r.upstream, "primary.") {
		t.Fatalf("after the primary's API answered: via %q", r.upstream)
	}
	if ps := provider(t, p, "primary"); !ps.Available || ps.Failbacks != 1 {
		t.Fatalf("primary: %+v", ps)
	}
}

// TestProviderAPIKeepsFailing: a primary whose API fails three refreshes
// in a row is passed over while the secondary can serve, and taken back
// when its API answers.
func TestProviderAPIKeepsFailing(t *testing.T) {
	pri, _, cfg := twoProviders(t, fakeprovider.Options{}, fakeprovider.Options{})
	o := newOrigin(t, false)
	logger, _ := testLogger(t)
	p := newPool(t, cfg, logger)
	pri.SetAPIMode(fakeprovider.APIGarbage)
	for range 3 {
		upstream.RefreshNow(context.Background(), p)
	}
	if r := mustGet(t, p, o.URL, clientinfo.Info{}); !strings.HasPrefix(r.upstream, "secondary.") {
		t.Fatalf("primary API failing: via %q", r.upstream)
	}
	if ps := provider(t, p, "primary"); ps.Available || !strings.Contains(ps.Reason, "API failed 3") {
		t.Fatalf("primary: %+v", ps)
	}
	pri.SetAPIMode(fakeprovider.APIOK)
	upstream.RefreshNow(context.Background(), p)
	if r := mustGet(t, p, o.URL, clientinfo.Info{}); !strings.HasPrefix(r.upstream, "primary.") {
		t.Fatalf("primary API back: via %q", r.upstream)
	}
}

// TestProviderGatewayRefuses: the primary's gateway stops accepting
// connections: the first request fails over inside its RoundTrip, the
// next ones go straight to the secondary (the other primary session is
// not tried one by one).
func TestProviderGatewayRefuses(t *testing.T) {
	pri, _, cfg := twoProviders(t, fakeprovider.Options{}, fakeprovider.Options{})
	o := newOrigin(t, false)
	logger, logs := testLogger(t)
	p := newPool(t, cfg, logger)
	pri.Close() // the gateway's port is closed
	for i := range 5 {
		r := mustGet(t, p, o.URL, clientinfo.Info{})
		if r.status != 200 || !strings.HasPrefix(r.upstream, "secondary.") {
			t.Fatalf("request %d: %d via %q", i, r.status, r.upstream)
		}
	}
	ps := provider(t, p, "primary")
	if ps.Available || len(ps.Gateways) != 1 || !strings.Contains(ps.Reason, "refuses connections") {
		t.Fatalf("primary: %+v", ps)
	}
	if n := strings.Count(logs.String(), "upstream gateway refuses connections"); n != 1 {
		t.Errorf("gateway refusal logged %d times", n)
	}
	if tried := statusOf(t, p, "primary.s1").Requests + statusOf(t, p, "primary.s2").Requests; tried != 1 {
		t.Errorf("primary sessions tried %d times, want once (then the gateway sits out)", tried)
	}
}

// TestCountryTargeting: sessions carry the countries their provider's API
// gives; a request for DE exits only from a DE session, one for a country
// no session is in gets a 503 naming it, and bad countries are refused at
// the config.
func TestCountryTargeting(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 4, Countries: []string{"us", "de", "us", "de"}})
	o := newOrigin(t, false)
	logger, _ := testLogger(t)
	p := newPool(t, providerConfig(fp), logger)
	de := map[string]bool{exitIP(t, fp, "s2"): true, exitIP(t, fp, "s4"): true}
	for i := range 20 {
		r := mustGet(t, p, o.URL, clientinfo.Info{Country: "DE", Key: string(rune('a' + i))})
		if r.status != 200 || !de[r.body] || (r.upstream != "s2" && r.upstream != "s4") {
			t.Fatalf("request %d for DE: %d from %s via %s", i, r.status, r.body, r.upstream)
		}
	}
	if st := statusOf(t, p, "s2"); st.Country != "DE" {
		t.Errorf("s2's country %q", st.Country)
	}
	_, err := send(t, p, http.MethodGet, o.URL, clientinfo.Info{Country: "FR"}, "")
	var ex *upstream.ExhaustedError
	if !errors.As(err, &ex) || ex.HTTPStatus() != 503 || ex.Country != "FR" ||
		!strings.Contains(err.Error(), "no upstream session in country FR") || !strings.Contains(err.Error(), "DE, US") {
		t.Fatalf("request for FR: %v", err)
	}
	// Both DE sessions cool down: the 503 says so; US still serves.
	fp.SetMode("s2", fakeprovider.Mode429)
	fp.SetMode("s4", fakeprovider.Mode429)
	if r := mustGet(t, p, o.URL, clientinfo.Info{Country: "DE"}); r.status != 429 || (r.upstream != "s2" && r.upstream != "s4") {
		t.Fatalf("DE request while both DE gateways rate-limit: %+v (never another country's session)", r)
	}
	_, err = send(t, p, http.MethodGet, o.URL, clientinfo.Info{Country: "DE"}, "")
	if !errors.As(err, &ex) || !strings.Contains(err.Error(), "upstream sessions in country DE are cooling down") {
		t.Fatalf("DE sessions cooling: %v", err)
	}
	if r := mustGet(t, p, o.URL, clientinfo.Info{Country: "US"}); r.upstream != "s1" && r.upstream != "s3" {
		t.Fatalf("US request via %s", r.upstream)
	}
	// A rule's country applies to requests that ask for none.
	cfg := providerConfig(fp)
	cfg.Rules = []upstream.RuleConfig{{Host: "127.0.0.1", Country: "us"}}
	p2 := newPool(t, cfg, logger)
	if r := mustGet(t, p2, o.URL, clientinfo.Info{}); r.upstream != "s1" && r.upstream != "s3" {
		t.Fatalf("rule country US: via %s", r.upstream)
	}

	bad := providerConfig(fp)
	bad.Sessions = []upstream.SessionConfig{{ID: "x", URL: "http://gw:1", Country: "uk"}}
	bad.Rules = []upstream.RuleConfig{{Country: "zz"}}
	err = bad.Validate(nil)
	if err == nil || !strings.Contains(err.Error(), "sessions[0].country") || !strings.Contains(err.Error(), "use GB") ||
		!strings.Contains(err.Error(), "rules[0].country") {
		t.Fatalf("bad countries: %v", err)
	}
}

// TestReconfigure applies a new upstream section while a request is in
// flight: the request finishes, sessions that stay keep their cooldowns,
// a new provider serves at once, rules and when_exhausted change; an
// invalid section changes nothing.
func TestReconfigure(t *testing.T) {
	pri, sec, cfg := twoProviders(t, fakeprovider.Options{}, fakeprovider.Options{})
	o := newOrigin(t, false)
	release := make(chan struct{})
	arrived := make(chan struct{}, 1)
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		if r.URL.Path == "/slow" {
			arrived <- struct{}{}
			<-release
		}
		return false
	})
	logger, _ := testLogger(t)
	only := upstream.Config{Providers: cfg.Providers[:1]}
	p := newPool(t, only, logger)
	pri.SetMode("s1", fakeprovider.Mode429)
	mustGet(t, p, o.URL, clientinfo.Info{Session: "primary.s1"}) // s1 cools down, s2 answers
	if statusOf(t, p, "primary.s1").Available {
		t.Fatal("primary.s1 did not cool down")
	}
	slow := make(chan result, 1)
	go func() { slow <- mustGet(t, p, o.URL+"/slow", clientinfo.Info{Session: "primary.s2"}) }()
	<-arrived

	if err := p.Reconfigure(upstream.Config{Providers: []upstream.ProviderConfig{{Name: "primary"}}}); err == nil ||
		!strings.Contains(err.Error(), "providers[0].api: required") {
		t.Fatalf("invalid config: %v", err)
	}
	if len(p.Providers()) != 2 || statusOf(t, p, "primary.s1").Available { // "sessions" and primary
		t.Fatal("a refused reconfiguration changed something")
	}

	next := cfg
	next.Rules = []upstream.RuleConfig{{Name: "geo", Host: "127.0.0.1", Country: "us"}}
	next.WhenExhausted = "direct"
	sec.SetCountry("s1", "us")
	if err := p.Reconfigure(next); err != nil {
		t.Fatal(err)
	}
	close(release)
	if r := <-slow; r.status != 200 || r.upstream != "primary.s2" {
		t.Fatalf("request in flight across the reconfiguration: %+v", r)
	}
	if st := statusOf(t, p, "primary.s1"); st.Available || st.CooldownReason != "rate_limited" {
		t.Fatalf("primary.s1 lost its cooldown: %+v", st)
	}
	// The rule sends requests to the only US session, the new provider's.
	if r := mustGet(t, p, o.URL, clientinfo.Info{}); r.upstream != "secondary.s1" {
		t.Fatalf("after reconfiguring: via %q", r.upstream)
	}
	if got := upstream.RuleFor(p, "127.0.0.1", "/"); got != "geo" {
		t.Fatalf("rule %q", got)
	}
	if !strings.Contains(p.Describe(), "when_exhausted=direct") {
		t.Fatalf("describe: %s", p.Describe())
	}
	// Removing a provider takes its sessions out.
	if err := p.Reconfigure(upstream.Config{Providers: cfg.Providers[1:]}); err != nil {
		t.Fatal(err)
	}
	for _, s := range p.Sessions() {
		if strings.HasPrefix(s.ID, "primary.") {
			t.Fatalf("session %s of a removed provider", s.ID)
		}
	}
}

// TestTimedSessionConnectionsRecycled: a timed session's pooled
// connections are closed once per interval, so a keep-alive connection
// opened before the provider rotated does not keep the old exit IP;
// sticky sessions keep theirs.
func TestTimedSessionConnectionsRecycled(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, false)
	logger, _ := testLogger(t)
	cfg := upstream.Config{Sessions: []upstream.SessionConfig{
		{ID: "timed", URL: fp.URL("s1", "http"), Rotation: "timed", Interval: 2 * time.Second},
		{ID: "sticky", URL: fp.URL("s2", "http")},
	}}
	p := newPool(t, cfg, logger)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	defer func() { cancel(); <-done }()
	use := func() {
		mustGet(t, p, o.URL, clientinfo.Info{Session: "timed"})
		mustGet(t, p, o.URL, clientinfo.Info{Session: "sticky"})
	}
	for range 3 {
		use()
	}
	if a, b := fp.Conns("s1"), fp.Conns("s2"); a != 1 || b != 1 {
		t.Fatalf("gateway connections %d and %d for 3 requests each, want one kept alive per session", a, b)
	}
	// Within a few intervals the timed session's connection is recycled
	// (a new one is opened), the sticky one's is not.
	testkit.Eventually(t, testkit.Patience, func() bool {
		use()
		return fp.Conns("s1") >= 2
	}, "the timed session's connection to be recycled")
	if n := fp.Conns("s2"); n != 1 {
		t.Fatalf("the sticky session opened %d connections, want its one kept alive", n)
	}
	// Recycling is per interval, not per request.
	before := fp.Conns("s1")
	use()
	if n := fp.Conns("s1"); n > before+1 {
		t.Fatalf("the timed session opened %d connections for one request", n-before)
	}
}
