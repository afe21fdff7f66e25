package upstream

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// A provider is a group of sessions that share a priority and a price: an
// entry of upstream.providers (or the shorthand upstream.provider) with
// its API client, or the hand-listed sessions that name no provider (the
// "sessions" group, which has no API).
//
// Failover: requests go to the sessions of the highest priority that can
// take them (see pick). A provider drops out of that choice while its API
// keeps failing (apiDownAfter refreshes in a row) or, per gateway address,
// while its gateway refuses connections; cooling sessions drop out one by
// one. It comes back by itself: its API answers, a gateway's benching
// ends and the next request tries it, or a cooldown ends. Only when no
// provider can take a request are the benched ones used anyway: a request
// that might work beats a 503 that will.
type provider struct {
	name      string
	priority  int
	price     dedup.Price
	countries map[string]bool // nil: whatever its sessions say
	// onlyCountry is the country of listed sessions that name none, when
	// countries has exactly one entry.
	onlyCountry string
	cfg         ProviderConfig  // with defaults; zero for the "sessions" group
	client      *providerClient // nil for the "sessions" group
	qualify     bool            // session ids are "NAME.ID" (upstream.providers)

	// apiDown: the API failed apiDownAfter refreshes in a row; read on the
	// hot path.
	apiDown atomic.Bool
	// up is the availability last logged (see checkProviders).
	up                   atomic.Bool
	failovers, failbacks atomic.Int64

	// fetch serializes this provider's list fetches (the refresh loop, a
	// refresh asked for by a binding to a session not listed yet).
	fetch     sync.Mutex
	lastAsked atomic.Int64 // unix nanos of the last fetch a binding asked for
	// notBefore (unix nanos) is when the API asked, by a Retry-After on
	// its refusal of a list fetch, to be called again: a rate-limited API
	// called on our own schedule only stays limited.
	notBefore atomic.Int64

	// Guarded by Pool.mu.
	sessions []*session
	refresh  RefreshStatus
	failures int // consecutive refresh failures
	listed   int // sessions in the API's last good answer, before cfg.MaxSessions
	gateways map[string]*gateway
}

// apiDownAfter consecutive failed refreshes take a provider out of the
// choice while another one can serve.
const apiDownAfter = 3

// gateway is the health of one gateway address (host:port) of a provider:
// a gateway that refuses connections benches every session behind it at
// once, without holding it against the sessions themselves.
type gateway struct {
	addr      string
	downUntil atomic.Int64 // unix nanos; 0 = answering
	strikes   atomic.Int32 // refusals in a row
}

// A refusing gateway is benched for gatewayCool, doubled per refusal in a
// row up to gatewayCoolMax: short, because its return is how a provider
// fails back, and a refused connection is cheap to try again.
const (
	gatewayCool    = 15 * time.Second
	gatewayCoolMax = 5 * time.Minute
)

func (g *gateway) down(now int64) bool {
	u := g.downUntil.Load()
	return u != 0 && now < u
}

// refused benches the gateway; it reports whether it was answering until
// now. Refusals while it is benched (requests under way when it went
// down, the round's probe) leave the benching as it is: one outage is one
// strike, not one per connection that met it.
func (g *gateway) refused(now time.Time) bool {
	if g.down(now.UnixNano()) {
		return false
	}
	n := g.strikes.Add(1)
	d := gatewayCool << min(n-1, 8)
	d = min(d, gatewayCoolMax)
	was := !g.down(now.UnixNano())
	g.downUntil.Store(now.Add(d).UnixNano())
	return was
}

// answered ends a benching: the gateway took a connection. It reports
// whether the gateway was benched.
func (g *gateway) answered() bool {
	if g.strikes.Load() == 0 && g.downUntil.Load() == 0 {
		return false
	}
	g.strikes.Store(0)
	return g.downUntil.Swap(0) != 0
}

// gatewayUnreachable reports whether err is a failure to connect to the
// gateway itself (refused, timed out, unreachable), as opposed to the
// gateway's answer or the origin's: the only dial a session makes from
// this host is to its gateway.
func gatewayUnreachable(err error) bool {
	for err != nil {
		if oe, ok := err.(*net.OpError); ok && oe.Op == "dial" {
			return true
		}
		err = errors.Unwrap(err)
	}
	return false
}

// newProvider builds the group for pc (with defaults). price is the
// savings section's, for the prices pc leaves unset.
func newProvider(pc ProviderConfig, qualify bool, def dedup.Price) *provider {
	pv := &provider{name: pc.Name, priority: pc.Priority, cfg: pc, qualify: qualify, price: def,
		gateways: map[string]*gateway{}}
	if pc.PricePerGB != nil {
		pv.price.PerGB = *pc.PricePerGB
	}
	if pc.PricePer1000Requests != nil {
		pv.price.Per1000Requests = *pc.PricePer1000Requests
	}
	if len(pc.Countries) > 0 {
		pv.countries = map[string]bool{}
		for _, c := range pc.Countries {
			cc, _ := clientinfo.ParseCountry(c) // validated
			pv.countries[cc] = true
		}
		if len(pv.countries) == 1 {
			for c := range pv.countries {
				pv.onlyCountry = c
			}
		}
	}
	return pv
}

// gatewayFor returns the shared health of the gateway at addr. Caller
// holds Pool.mu.
func (pv *provider) gatewayFor(addr string) *gateway {
	g := pv.gateways[addr]
	if g == nil {
		g = &gateway{addr: addr}
		pv.gateways[addr] = g
	}
	return g
}

// serves reports whether the provider may serve requests for country
// ("" any).
func (pv *provider) serves(country string) bool {
	return country == "" || pv.countries == nil || pv.countries[country]
}

// sessionID is the pool's id of the session the provider's API calls id.
func (pv *provider) sessionID(id string) string {
	if pv.qualify {
		return pv.name + "." + id
	}
	return id
}

// sameAPI reports whether pv talks to the same API as pc, so that a
// reconfiguration can keep its sessions and state.
func (pv *provider) sameAPI(pc ProviderConfig, key string) bool {
	return pv.client != nil && pv.cfg.API == pc.API && pv.client.key == key && pv.cfg.Protocol == pc.Protocol &&
		pv.cfg.Timeout == pc.Timeout
}

// availability says whether the provider can take requests now (its API
// answers, a session is ready behind a gateway that answers) and, when it
// cannot, why.
func (pv *provider) availability(sessions []*session, now time.Time) (bool, string) {
	t := tally{sessions: len(sessions)}
	n := now.UnixNano()
	for _, s := range sessions {
		if t.add(s, n) {
			break // one ready session is enough to know
		}
	}
	return pv.verdict(t)
}

// tally counts a provider's sessions by whether they can take a request.
type tally struct {
	sessions, ready, cooling int
	refusing                 string // a gateway that refuses connections
}

// add counts s at n (unix nanoseconds) and reports whether it is ready.
func (t *tally) add(s *session, n int64) bool {
	switch {
	case s.gw.down(n):
		t.refusing = s.gw.addr
	case !s.h.available(n):
		t.cooling++
	default:
		t.ready++
		return true
	}
	return false
}

// verdict is availability's answer from a tally of the provider's
// sessions.
func (pv *provider) verdict(t tally) (bool, string) {
	switch {
	case pv.apiDown.Load():
		return false, fmt.Sprintf("its API failed %d refreshes in a row", apiDownAfter)
	case t.sessions == 0:
		return false, "it has no sessions"
	case t.ready > 0:
		return true, ""
	case t.cooling == 0:
		return false, "its gateway " + t.refusing + " refuses connections"
	}
	return false, fmt.Sprintf("all %d of its sessions are cooling down or behind a refusing gateway", t.sessions)
}

// checkProviders logs and counts each provider's change of availability
// once: a provider that can no longer take requests fails its traffic
// over to the next priority; one that can again takes it back. It runs
// after refreshes and marks, and every second from Run (cooldowns and
// benchings end with time).
func (p *Pool) checkProviders() {
	if !p.checkMu.TryLock() {
		return // another check is at it
	}
	defer p.checkMu.Unlock()
	now := p.now()
	set := p.sessions.Load()
	groups := p.st.Load().groups
	type state struct {
		pv     *provider
		up     bool
		reason string
	}
	states := make([]state, 0, len(groups))
	for _, pv := range groups {
		up, reason := pv.availability(set.byProvider[pv], now)
		states = append(states, state{pv, up, reason})
	}
	// next names where a provider's traffic goes: the best other provider
	// that is up.
	next := func(self *provider) string {
		for _, st := range states {
			if st.pv != self && st.up {
				return st.pv.name
			}
		}
		return "none (requests get 503, or go direct with when_exhausted: direct)"
	}
	for _, st := range states {
		if st.pv.up.Swap(st.up) == st.up {
			continue
		}
		if st.up {
			st.pv.failbacks.Add(1)
			p.log.Info("upstream provider available again: failing back to it", "provider", st.pv.name,
				"priority", st.pv.priority)
			continue
		}
		st.pv.failovers.Add(1)
		p.log.Warn("upstream provider unavailable: failing over", "provider", st.pv.name,
			"priority", st.pv.priority, "reason", st.reason, "to", next(st.pv))
	}
}

// initProviders sets each provider's availability without logging a
// change: how the pool starts is no failover.
func (p *Pool) initProviders() {
	now := p.now()
	set := p.sessions.Load()
	for _, pv := range p.st.Load().groups {
		up, reason := pv.availability(set.byProvider[pv], now)
		pv.up.Store(up)
		if !up && pv.client != nil {
			p.log.Warn("upstream provider not available at start-up", "provider", pv.name, "reason", reason)
		}
	}
}

// sortGroups orders groups by priority, highest first, then by name.
func sortGroups(groups []*provider) {
	slices.SortStableFunc(groups, func(a, b *provider) int {
		if c := cmp.Compare(b.priority, a.priority); c != 0 {
			return c
		}
		return strings.Compare(a.name, b.name)
	})
}

// PriceOf is what a request through upstream (an X-Onceproxy-Upstream
// value: a session id, or "direct") costs: its session's provider's
// prices, else the savings section's. It makes the Pool a dedup.Prices.
func (p *Pool) PriceOf(upstream string) dedup.Price {
	if s := p.sessions.Load().byID[upstream]; s != nil {
		if pv := s.prov.Load(); pv != nil {
			return pv.price
		}
	}
	return p.defPrice
}

var _ dedup.Prices = (*Pool)(nil)

// ProviderStatus is one provider (or the hand-listed sessions' group) as
// the admin API shows it.
type ProviderStatus struct {
	Name     string `json:"name"`
	Priority int    `json:"priority"`
	// API is the base URL ("" for the hand-listed sessions).
	API string `json:"api,omitempty"`
	// Available is false while the provider cannot take requests; Reason
	// says why.
	Available bool   `json:"available"`
	Reason    string `json:"reason,omitempty"`
	// Sessions is how many sessions the provider has now; Ready how many
	// of them can take a request.
	Sessions  int      `json:"sessions"`
	Ready     int      `json:"ready"`
	Countries []string `json:"countries,omitempty"`
	// PricePerGB and PricePer1000Requests are what its sessions cost in
	// the savings report (its own prices, else the savings section's).
	PricePerGB           float64         `json:"price_per_gb"`
	PricePer1000Requests float64         `json:"price_per_1000_requests"`
	Failovers            int64           `json:"failovers"`
	Failbacks            int64           `json:"failbacks"`
	Refresh              *RefreshStatus  `json:"refresh,omitempty"`
	Gateways             []GatewayStatus `json:"gateways,omitempty"`
}

// RefreshStatus is how a provider's API has been answering.
type RefreshStatus struct {
	LastRefresh time.Time `json:"last_refresh,omitzero"`
	// LastError is the last refresh's failure; "" once one succeeds.
	LastError   string    `json:"last_error,omitempty"`
	LastErrorAt time.Time `json:"last_error_at,omitzero"`
	Refreshes   int64     `json:"refreshes"`
	Failures    int64     `json:"failures"`
	// InARow counts the failures since the last success.
	InARow int `json:"failures_in_a_row"`
	// NextTry is when the API is called next (while Run runs), after the
	// refresh interval, or a failure's backoff and the API's Retry-After;
	// NextTryIn the time left ("41s").
	NextTry   time.Time `json:"next_try,omitzero"`
	NextTryIn string    `json:"next_try_in,omitempty"`
}

// GatewayStatus is a gateway address that refused connections lately.
type GatewayStatus struct {
	Addr      string    `json:"addr"`
	DownUntil time.Time `json:"down_until"`
}

// Providers lists the providers by priority, highest first.
func (p *Pool) Providers() []ProviderStatus { return p.Snapshot().Providers }

// refreshSoon fetches pv's list now, for a binding that names a session
// this instance has not listed yet (another instance refreshed first),
// unless such a fetch ran within minRefetch: whatever the store says, the
// provider's API sees at most one extra call per minRefetch. It reports
// whether the list was fetched.
//
// It runs on a request's path, so it never waits long: not for an API
// known to be down, not behind a fetch already under way (the refresh
// loop's, which may hang for the API's whole timeout), and not past
// bindingFetchWait. A binding it cannot confirm in time is not final: the
// request goes to another session, and the binding stays for later ones.
func (p *Pool) refreshSoon(ctx context.Context, pv *provider) bool {
	now := p.now().UnixNano()
	last := pv.lastAsked.Load()
	if pv.client == nil || pv.apiDown.Load() || now < pv.notBefore.Load() || time.Duration(now-last) < minRefetch ||
		!pv.lastAsked.CompareAndSwap(last, now) {
		return false
	}
	if !pv.fetch.TryLock() {
		return false
	}
	defer pv.fetch.Unlock()
	ctx, cancel := context.WithTimeout(ctx, min(pv.cfg.Timeout, bindingFetchWait))
	defer cancel()
	return p.refreshLocked(ctx, pv) == nil
}

// bindingFetchWait bounds the list fetch a binding asks for on a request's
// path: a provider API answers well within it, and one that does not
// must not hold the request for its whole timeout.
const bindingFetchWait = 500 * time.Millisecond

// minRefetch bounds the refreshes bindings can ask for: one per provider
// per this long, whatever the fleet's store says.
const minRefetch = 2 * time.Second
