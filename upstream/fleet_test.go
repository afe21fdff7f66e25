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
)

// hub is the fleet seam for these tests: it hands each pool's news to the
// other pools, as the Redis channel does between processes.
type hub struct {
	mu     sync.Mutex
	pools  []*upstream.Pool
	sent   []upstream.SessionEvent
	claims map[string]int // session → instance claiming its rotation
}

// LockRotation is the hub's claim table, as Redis keeps it for a fleet.
func (m member) LockRotation(_ context.Context, session string, _ time.Duration) (func(), bool) {
	m.h.mu.Lock()
	defer m.h.mu.Unlock()
	if m.h.claims == nil {
		m.h.claims = map[string]int{}
	}
	if holder, held := m.h.claims[session]; held && holder != m.i {
		return nil, false
	}
	m.h.claims[session] = m.i
	return func() {
		m.h.mu.Lock()
		delete(m.h.claims, session)
		m.h.mu.Unlock()
	}, true
}

type member struct {
	h *hub
	i int
}

func (m member) PublishSession(ev upstream.SessionEvent) {
	m.h.mu.Lock()
	m.h.sent = append(m.h.sent, ev)
	others := make([]*upstream.Pool, 0, len(m.h.pools))
	for j, p := range m.h.pools {
		if j != m.i {
			others = append(others, p)
		}
	}
	m.h.mu.Unlock()
	for _, p := range others {
		p.ApplySessionEvent(ev)
	}
}

// twoInstances builds two pools over cfg that share news through a hub.
func twoInstances(t *testing.T, cfg upstream.Config) (a, b *upstream.Pool, h *hub) {
	t.Helper()
	h = &hub{}
	logger, _ := testLogger(t)
	for i := range 2 {
		p, err := upstream.New(cfg, logger.With("instance", i), upstream.WithFleet(member{h, i}))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		h.mu.Lock()
		h.pools = append(h.pools, p)
		h.mu.Unlock()
	}
	return h.pools[0], h.pools[1], h
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
	if st.Available || st.CooldownReason != "rate_limited" {
		t.Fatalf("instance B did not bench one: %+v (news sent: %+v)", st, h.sent)
	}
	if left := time.Until(st.CooldownUntil); left < 590*time.Second || left > 601*time.Second {
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
