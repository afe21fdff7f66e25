package upstream

import (
	"cmp"
	"slices"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/redact"
)

// SessionStatus is one session as the admin API shows it
// (GET /upstream/sessions). It never carries a password or the API key.
type SessionStatus struct {
	ID string `json:"id"`
	// Source is "config" or "provider"; Provider names its group (a
	// provider's name, or "sessions" for hand-listed ones of none) and
	// Priority the group's.
	Source   string `json:"source"`
	Provider string `json:"provider"`
	Priority int    `json:"priority"`
	// Country and City are where its exit IP is, when known.
	Country string `json:"country,omitempty"`
	City    string `json:"city,omitempty"`
	// Proxy is the gateway URL with the password masked.
	Proxy    string `json:"proxy"`
	Rotation string `json:"rotation"`
	// Interval is the rotation period of a timed session ("10m0s").
	Interval string `json:"interval,omitempty"`
	// BaseWeight is the configured weight (traffic share, sticky hashing);
	// Weight the current health weight (1-10).
	BaseWeight int `json:"base_weight"`
	Weight     int `json:"weight"`
	// ConsecutiveFailures counts the session's own failures (connection
	// errors, a gateway's 429); it resets on success, and 3 mean a 10
	// minute cooldown. An origin's 429s and bans count per site
	// (CoolingSites), its 5xx not at all.
	ConsecutiveFailures int `json:"consecutive_failures"`
	// Available is false while the session cools down for every site.
	Available         bool      `json:"available"`
	CooldownUntil     time.Time `json:"cooldown_until,omitzero"`
	CooldownRemaining string    `json:"cooldown_remaining,omitempty"`
	CooldownReason    string    `json:"cooldown_reason,omitempty"`
	// CoolingSites are the sites (hosts) the session sits out after
	// their 429 or ban, by host, the first 100.
	CoolingSites []SiteCooldown `json:"cooling_sites,omitempty"`
	// LastOutcome is ok, rate_limited, banned, connection_error or
	// server_error; LastError its detail.
	LastOutcome string    `json:"last_outcome,omitempty"`
	LastError   string    `json:"last_error,omitempty"`
	LastUsed    time.Time `json:"last_used,omitzero"`
	// ExitIP is the session's current exit IP when known (from the
	// provider API or an IP-echo health URL).
	ExitIP    string `json:"exit_ip,omitempty"`
	Requests  int64  `json:"requests"`
	Failures  int64  `json:"failures"`
	Rotations int64  `json:"rotations"`
}

// SiteCooldown is a session's cooldown at one site: an origin's 429 or
// ban says "this exit IP, at this site".
type SiteCooldown struct {
	Host      string    `json:"host"`
	Until     time.Time `json:"until"`
	Remaining string    `json:"remaining"`
	Reason    string    `json:"reason"`
}

// maxSitesShown bounds SessionStatus.CoolingSites.
const maxSitesShown = 100

// SiteCooldowns counts the (session, site) pairs sitting out now: each a
// session whose exit IP a site answered with a 429 or a ban. Many at once
// are a site limiting the pool, which no session's own state shows.
func (p *Pool) SiteCooldowns() int {
	now := p.now()
	n := 0
	for _, s := range p.sessions.Load().list {
		n += s.h.sitesCooling(now)
	}
	return n
}

// Snapshot is the pool as one metrics scrape reads it: every session's
// numbers and every provider's status, from one walk of the sessions.
type Snapshot struct {
	// Sessions are in the order of Providers, each provider's by id.
	Sessions  []SessionCounts
	Providers []ProviderStatus
	// SiteCooldowns is what SiteCooldowns counts.
	SiteCooldowns int
	// Cooling counts the sessions cooling down for every site.
	Cooling int
}

// SessionCounts is one session's numbers for metrics.
type SessionCounts struct {
	ID, Provider       string
	Requests, Failures int64
	Weight             int // the health weight, 1-10
	Available          bool
}

// Snapshot reads every session once and takes the pool's lock once, for
// the providers' own state (refresh status, refusing gateways); the
// sessions' part is their lock-free mirrors. A scrape used to read the
// sessions once per metric showing them, and the providers (under the
// lock, which refreshes and requests meeting an empty pool take too) six
// times.
func (p *Pool) Snapshot() Snapshot {
	now := p.now()
	n := now.UnixNano()
	set := p.sessions.Load()
	groups := p.st.Load().groups
	snap := Snapshot{Sessions: make([]SessionCounts, 0, len(set.list)), Providers: make([]ProviderStatus, 0, len(groups))}
	for _, pv := range groups {
		list := set.byProvider[pv]
		t := tally{sessions: len(list)}
		for _, s := range list {
			t.add(s, n)
			avail := s.h.available(n)
			if !avail {
				snap.Cooling++
			}
			snap.SiteCooldowns += s.h.sitesCooling(now)
			snap.Sessions = append(snap.Sessions, SessionCounts{ID: s.id, Provider: pv.name,
				Requests: s.h.requests.Load(), Failures: s.h.failed.Load(), Weight: s.h.currentWeight(), Available: avail})
		}
		st := ProviderStatus{Name: pv.name, Priority: pv.priority, PricePerGB: pv.price.PerGB, PricePer1000Requests: pv.price.Per1000Requests,
			Failovers: pv.failovers.Load(), Failbacks: pv.failbacks.Load(), Sessions: len(list), Ready: t.ready}
		st.Available, st.Reason = pv.verdict(t)
		for c := range pv.countries {
			st.Countries = append(st.Countries, c)
		}
		slices.Sort(st.Countries)
		if pv.client != nil {
			st.API = pv.client.base
		}
		snap.Providers = append(snap.Providers, st)
	}
	// What only the lock guards: short, no session in it.
	p.mu.Lock()
	for i, pv := range groups {
		st := &snap.Providers[i]
		if pv.client != nil {
			r := pv.refresh
			r.InARow = pv.failures
			r.NextTry = pv.nextTry(now)
			r.NextTryIn = max(r.NextTry.Sub(now), 0).Round(time.Second).String()
			st.Refresh = &r
		}
		for _, g := range pv.gateways {
			if g.down(n) {
				st.Gateways = append(st.Gateways, GatewayStatus{Addr: g.addr, DownUntil: time.Unix(0, g.downUntil.Load())})
			}
		}
	}
	p.mu.Unlock()
	return snap
}

// Sessions lists the sessions, sorted by id.
func (p *Pool) Sessions() []SessionStatus {
	now := p.now()
	list := p.sessions.Load().list
	out := make([]SessionStatus, 0, len(list))
	for _, s := range list {
		h := s.h.snapshot()
		pv := s.prov.Load()
		st := SessionStatus{
			ID:                  s.id,
			Source:              s.source,
			Provider:            pv.name,
			Priority:            pv.priority,
			Country:             s.country,
			City:                s.city,
			Proxy:               redact.ParsedURL(s.proxyURL),
			Rotation:            s.rotation,
			BaseWeight:          s.baseWeight,
			Weight:              h.weight,
			ConsecutiveFailures: h.failures,
			Available:           !now.Before(h.coolUntil),
			LastUsed:            h.lastAt,
			ExitIP:              s.currentExitIP(),
			Requests:            s.h.requests.Load(),
			Failures:            s.h.failed.Load(),
			Rotations:           s.h.rotations.Load(),
		}
		if s.rotation == RotationTimed {
			st.Interval = s.interval.String()
		}
		if h.last != outcomeNone {
			st.LastOutcome = h.last.String()
			st.LastError = h.lastErr
		}
		if !st.Available {
			st.CooldownUntil = h.coolUntil
			st.CooldownRemaining = h.coolUntil.Sub(now).Round(time.Second).String()
			st.CooldownReason = h.coolReason.String()
		}
		st.CoolingSites = s.h.coolingSites(now, maxSitesShown)
		out = append(out, st)
	}
	return out
}

func sortSessions(list []*session) {
	slices.SortFunc(list, func(a, b *session) int { return cmp.Compare(a.id, b.id) })
}
