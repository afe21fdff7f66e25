package upstream

import (
	"cmp"
	"slices"
	"time"
)

// SessionStatus is one session as the admin API shows it
// (GET /upstream/sessions). It never carries a password or the API key.
type SessionStatus struct {
	ID string `json:"id"`
	// Source is "config" or "provider".
	Source string `json:"source"`
	// Proxy is the gateway URL with the password masked.
	Proxy    string `json:"proxy"`
	Rotation string `json:"rotation"`
	// Interval is the rotation period of a timed session ("10m0s").
	Interval string `json:"interval,omitempty"`
	// BaseWeight is the configured weight (traffic share, sticky hashing);
	// Weight the current health weight (1-10).
	BaseWeight int `json:"base_weight"`
	Weight     int `json:"weight"`
	// ConsecutiveFailures resets on success; 3 mean a 10 minute cooldown.
	ConsecutiveFailures int `json:"consecutive_failures"`
	// Available is false while cooling down.
	Available         bool      `json:"available"`
	CooldownUntil     time.Time `json:"cooldown_until,omitzero"`
	CooldownRemaining string    `json:"cooldown_remaining,omitempty"`
	CooldownReason    string    `json:"cooldown_reason,omitempty"`
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

// Sessions lists the sessions, sorted by id.
func (p *Pool) Sessions() []SessionStatus {
	now := p.now()
	list := p.sessions.Load().list
	out := make([]SessionStatus, 0, len(list))
	for _, s := range list {
		h := s.h.snapshot()
		st := SessionStatus{
			ID:                  s.id,
			Source:              s.source,
			Proxy:               s.proxyURL.Redacted(),
			Rotation:            s.rotation,
			BaseWeight:          s.baseWeight,
			Weight:              h.weight,
			ConsecutiveFailures: h.failures,
			Available:           !now.Before(h.coolUntil),
			LastUsed:            h.lastAt,
			ExitIP:              s.currentExitIP(),
			Requests:            s.h.requests.Load(),
			Failures:            s.h.failed.Load(),
			Rotations:           s.rotations.Load(),
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
		out = append(out, st)
	}
	return out
}

// ProviderStatus is the state of the provider API client.
type ProviderStatus struct {
	// API is the base URL ("" without a provider).
	API string `json:"api,omitempty"`
	// Sessions is how many sessions the last good list had.
	Sessions    int       `json:"sessions"`
	LastRefresh time.Time `json:"last_refresh,omitzero"`
	// LastError is the last refresh's failure; "" once one succeeds.
	LastError   string    `json:"last_error,omitempty"`
	LastErrorAt time.Time `json:"last_error_at,omitzero"`
	Refreshes   int64     `json:"refreshes"`
	Failures    int64     `json:"failures"`
}

// ProviderStatus reports how the provider API has been answering.
func (p *Pool) ProviderStatus() ProviderStatus {
	p.refreshMu.Lock()
	defer p.refreshMu.Unlock()
	return p.prov
}

func sortSessions(list []*session) {
	slices.SortFunc(list, func(a, b *session) int { return cmp.Compare(a.id, b.id) })
}
