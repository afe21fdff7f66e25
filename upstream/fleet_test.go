package upstream_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/upstream"
	"strings"
)

// hub is the fleet seam for these tests: it hands each pool's notes to the
// other pools, as the shared store's events channel does between processes.
type hub struct {
	mu       sync.Mutex
	handlers map[int]func(msg string, left time.Duration)
	sent     []string
	claims   map[string]int // claim name → instance holding it
}

type member struct {
	h *hub
	i int
}

func (m member) Publish(_, _, msg string, _ time.Duration) {
	m.h.mu.Lock()
	m.h.sent = append(m.h.sent, msg)
	var others []func(string, time.Duration)
	for j, f := range m.h.handlers {
		if j != m.i {
			others = append(others, f)
		}
	}
	m.h.mu.Unlock()
	for _, f := range others {
		f(msg, 0)
	}
}

func (m member) Subscribe(_ string, f func(msg string, left time.Duration)) {
	m.h.mu.Lock()
	defer m.h.mu.Unlock()
	if m.h.handlers == nil {
		m.h.handlers = map[int]func(string, time.Duration){}
	}
	m.h.handlers[m.i] = f
}

// Claim is the hub's claim table, as the shared store keeps it for a fleet.
func (m member) Claim(_ context.Context, name string, _ time.Duration) (func(), bool) {
	m.h.mu.Lock()
	defer m.h.mu.Unlock()
	if m.h.claims == nil {
		m.h.claims = map[string]int{}
	}
	if holder, held := m.h.claims[name]; held && holder != m.i {
		return nil, false
	}
	m.h.claims[name] = m.i
	return func() {
		m.h.mu.Lock()
		delete(m.h.claims, name)
		m.h.mu.Unlock()
	}, true
}

// twoInstances builds two pools over cfg that share news through a hub.
func twoInstances(t *testing.T, cfg upstream.Config) (a, b *upstream.Pool, h *hub) {
	t.Helper()
	h = &hub{}
	logger, _ := testLogger(t)
	var pools []*upstream.Pool
	for i := range 2 {
		p, err := upstream.New(cfg, logger.With("instance", i), upstream.WithBus(member{h, i}))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		pools = append(pools, p)
	}
	return pools[0], pools[1], h
}

// TestCooldownSharedWithTheFleet: a session rate-limited through one
// instance is benched on the others at once, for as long (Retry-After
// included): they never send it the requests that would collect their own
// 429s.
func TestCooldownSharedWithTheFleet(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, false)
	bad := exitIP(t, fp, "s1")
	o.rateLimit(bad, 600*time.Second)
	a, b, h := twoInstances(t, upstream.Config{Sessions: []upstream.SessionConfig{
		{ID: "one", URL: fp.URL("s1", "http")},
		{ID: "two", URL: fp.URL("s2", "http")},
	}})
	if r := mustGet(t, a, o.URL, clientinfo.Info{Session: "one"}); r.status != 200 || r.upstream != "two" {
		t.Fatalf("instance A: %+v, want 200 from two after one's 429", r)
	}
	st := statusOf(t, b, "one")
	sc, cooling := coolingAt(t, st, o.URL)
	if !cooling || sc.Reason != "rate_limited" {
		t.Fatalf("instance B did not bench one at the origin's site: %+v (news sent: %+v)", st, h.sent)
	}
	if !st.Available {
		t.Errorf("instance B benched one for every site after one site's 429: %+v", st)
	}
	if left := time.Until(sc.Until); left < 590*time.Second || left > 601*time.Second {
		t.Errorf("B's cooldown %v, want A's (about 600s, Retry-After)", left)
	}
	if st.Weight != 5 || st.ConsecutiveFailures != 0 {
		t.Errorf("B's own record of one changed: %+v", st)
	}
	for range 10 {
		if r := mustGet(t, b, o.URL, clientinfo.Info{Session: "one"}); r.status != 200 || r.upstream != "two" {
			t.Fatalf("instance B: %+v", r)
		}
	}
	if n := o.hitsOf(bad); n != 1 {
		t.Errorf("the rate-limited exit IP got %d requests from the fleet, want 1 (A's)", n)
	}
	// Only a cooldown is news: A's successes were not broadcast, and B
	// never echoes what it heard.
	if len(h.sent) != 1 {
		t.Errorf("news sent: %+v, want one cooldown", h.sent)
	}
}

// TestRotationSharedWithTheFleet: after one instance rotates a session,
// the others drop their tunnels to the old exit IP: their next request
// leaves from the new one.
func TestRotationSharedWithTheFleet(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, true)
	cfg := providerConfig(fp)
	cfg.CAFiles = []string{originCAFile(t, o.Server)}
	a, b, _ := twoInstances(t, cfg)
	hint := clientinfo.Info{Session: "s1"}
	before := mustGet(t, b, o.URL, hint) // B keeps a tunnel from s1's exit IP
	if before.upstream != "s1" || before.body != exitIP(t, fp, "s1") {
		t.Fatalf("before: %+v", before)
	}
	if err := a.Rotate(context.Background(), "s1"); err != nil {
		t.Fatal(err)
	}
	after := mustGet(t, b, o.URL, hint)
	if after.upstream != "s1" || after.body == before.body || after.body != exitIP(t, fp, "s1") {
		t.Fatalf("B after A rotated s1: left from %s (was %s, provider says %s)", after.body, before.body, exitIP(t, fp, "s1"))
	}
	if st := statusOf(t, b, "s1"); st.ExitIP != after.body {
		t.Errorf("B's status of s1: exit_ip %q, want %s", st.ExitIP, after.body)
	}
}

// TestOneRotationForTheFleet: two instances get a 429 from the same
// session at the same moment; the provider's rotate API is called once,
// and both clients get their page (one from the new exit IP or the other
// session).
func TestOneRotationForTheFleet(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, false)
	bad := exitIP(t, fp, "s1")
	var arrived sync.WaitGroup
	arrived.Add(2)
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		if ip != bad {
			return false
		}
		// Both instances' requests are at the origin before either
		// gets its 429.
		arrived.Done()
		arrived.Wait()
		http.Error(w, "slow down", http.StatusTooManyRequests)
		return true
	})
	a, b, _ := twoInstances(t, providerConfig(fp))
	type outcome struct {
		r   result
		err error
	}
	res := make(chan outcome, 2)
	for _, p := range []*upstream.Pool{a, b} {
		go func() {
			r, err := send(t, p, http.MethodGet, o.URL, clientinfo.Info{Session: "s1"}, "")
			res <- outcome{r, err}
		}()
	}
	for range 2 {
		if o := <-res; o.err != nil || o.r.status != 200 {
			t.Fatalf("client: %+v %v", o.r, o.err)
		}
	}
	if n := fp.Rotations("s1"); n != 1 {
		t.Errorf("the fleet rotated s1 %d times for one wall of 429s, want 1", n)
	}
}

// TestMalformedNotesAreIgnored: what arrives over the bus is untrusted. A
// note with an unknown reason used to crash the instance that heard it
// (outcome 255 passed failure() and String() indexed past its names);
// every bad note is now counted and ignored, live or recalled, and the
// session keeps serving.
func TestMalformedNotesAreIgnored(t *testing.T) {
	_, b, h := twoInstances(t, upstream.Config{Sessions: []upstream.SessionConfig{
		{ID: "s1", URL: "http://127.0.0.1:9"},
	}})
	bad := []string{
		`{"session":"s1","kind":"cooldown","for":60000000000,"reason":"bogus"}`,
		`{"session":"s1","kind":"cooldown","for":60000000000}`,
		`{"session":"s1","kind":"cooldown","for":-5,"reason":"rate_limited"}`,
		`{"session":"s1","kind":"cooldown","for":9223372036854775807,"reason":"rate_limited"}`,
		`{"session":"s1","kind":"cooldown","for":60000000000,"reason":"ok"}`,
		`{"session":"s1","kind":"explode"}`,
		`{"session":"s1","kind":"rotated","exit_ip":"not an ip"}`,
		`{"session":"../../etc","kind":"rotated"}`,
		`{"kind":"cooldown","for":60000000000,"reason":"rate_limited"}`,
		`{"session":"s1","kind":"cooldown","for":"soon","reason":"rate_limited"}`,
		`{"session":"s1","kind":"cooldown","for":60000000000,"reason":"rate_limited","host":"Example.COM:443"}`,
		`{"session":"s1","kind":"cooldown","for":60000000000,"reason":"rate_limited","host":"a b:80"}`,
		`{"session":"s1","kind":"cooldown","for":60000000000,"reason":"rate_limited","host":"` + strings.Repeat("a", 300) + `"}`,
		`not json at all`,
		``,
	}
	a := member{h, 0}
	for _, msg := range bad {
		a.Publish("session", "", msg, 0)
	}
	if n := b.NotesRejected(); n != int64(len(bad)) {
		t.Errorf("NotesRejected = %d, want %d", n, len(bad))
	}
	// A recalled lasting note carries what is left of it: a bad one is
	// ignored the same way.
	h.mu.Lock()
	hear := h.handlers[1]
	h.mu.Unlock()
	hear(`{"session":"s1","kind":"cooldown","for":60000000000,"reason":"bogus"}`, time.Minute)
	hear(`{"session":"s1","kind":"cooldown","for":60000000000,"reason":"rate_limited"}`, 2*time.Hour)
	if n := b.NotesRejected(); n != int64(len(bad))+2 {
		t.Errorf("NotesRejected = %d after two bad recalled notes, want %d", n, len(bad)+2)
	}
	if st := statusOf(t, b, "s1"); !st.Available {
		t.Fatalf("a rejected note benched s1: %+v", st)
	}
	// A good note still works afterwards.
	a.Publish("session", "s1", `{"session":"s1","kind":"cooldown","for":60000000000,"reason":"rate_limited"}`, time.Minute)
	if st := statusOf(t, b, "s1"); st.Available || st.CooldownReason != "rate_limited" {
		t.Fatalf("a good note after bad ones did not bench s1: %+v", st)
	}
}
