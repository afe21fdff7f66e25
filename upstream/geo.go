package upstream

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

// Geo targeting: a request that asks for a country (and city) is served
// only by sessions there (see usable); when none can take it the client
// hears which country and why, never an answer from elsewhere, and never a
// direct one (this host is in some country of its own).

// anyUsable reports whether any session could take an attempt of pr,
// skipping skip, benched providers included. It asks no store: it only
// tells whether a retry has somewhere to go.
func anyUsable(set *sessionSet, pr *pickReq, now time.Time, skip []*session) bool {
	n := now.UnixNano()
	return slices.ContainsFunc(set.list, func(s *session) bool { return usable(s, pr, n, skip, false) })
}

// where names the exit location pr asks for ("country DE", "DE, city
// berlin"); "" for none.
func (pr *pickReq) where() string {
	switch {
	case pr.country != "" && pr.city != "":
		return "in country " + pr.country + ", city " + pr.city
	case pr.country != "":
		return "in country " + pr.country
	case pr.city != "":
		return "in city " + pr.city
	}
	return ""
}

// exhaustedError says why no session can take a request of pr.
func (p *Pool) exhaustedError(set *sessionSet, pr *pickReq, now time.Time) *ExhaustedError {
	where := pr.where()
	if len(set.list) == 0 {
		last, next := p.lastProviderError(now)
		if next > 0 {
			// A client that backs off by Retry-After comes back when a
			// list may be in, not before.
			last += fmt.Sprintf(" (next try in %s)", next)
		}
		reason := "no upstream sessions yet: " + last
		if where != "" {
			reason = "no upstream session " + where + ": " + last + " (no sessions yet)"
		}
		return &ExhaustedError{Reason: reason, NextReady: next, Country: pr.country}
	}
	var matching []*session
	places := map[string]bool{}
	for _, s := range set.list {
		if inPlace(s, pr) {
			matching = append(matching, s)
		} else if s.country != "" {
			places[s.country] = true
		}
	}
	if len(matching) == 0 {
		have := slices.Sorted(maps.Keys(places))
		reason := fmt.Sprintf("no upstream session %s: none of the %d sessions is there", where, len(set.list))
		if len(have) > 0 {
			reason += " (they are in " + strings.Join(have, ", ") + ")"
		}
		return &ExhaustedError{Reason: reason, Country: pr.country}
	}
	// Each session is ready when both its own cooldown and its cooldown
	// at the request's site are over.
	var next time.Duration
	atSite := false // some session sits out the request's site alone
	nowN := now.UnixNano()
	for _, s := range matching {
		ready := max(s.h.aCoolUntil.Load(), nowN)
		if m := s.h.aSites.Load(); m != nil {
			if u, ok := (*m)[pr.site]; ok && u > ready {
				ready, atSite = u, atSite || s.h.available(nowN)
			}
		}
		if d := time.Duration(ready - nowN); d > 0 && (next == 0 || d < next) {
			next = d
		}
	}
	// Up, to the whole seconds Retry-After counts in: rounded, the last
	// half second became 0, which says "unknown".
	next = (next + time.Second - 1).Truncate(time.Second)
	n := len(matching)
	scope := "upstream sessions"
	if where != "" {
		scope += " " + where
	}
	cooling := "cooling down"
	if atSite {
		cooling += " for " + pr.site
	}
	reason := fmt.Sprintf("all %d %s are %s (next ready in %s)", n, scope, cooling, next)
	if n == 1 {
		one := "upstream session"
		if where != "" {
			one += " " + where
		}
		reason = fmt.Sprintf("the only %s (%s) is %s (ready in %s)", one, matching[0].id, cooling, next)
	}
	return &ExhaustedError{Sessions: n, NextReady: next, Reason: reason, Country: pr.country}
}

// lastProviderError is the latest refresh failure of the providers, for a
// pool that has no sessions, and the time until the next call of an API
// (0: none is due, or no API failed yet).
func (p *Pool) lastProviderError(now time.Time) (string, time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var last string
	var at time.Time
	var next time.Duration
	apis := p.st.Load().apiGroups()
	for _, pv := range apis {
		if r := pv.refresh; r.LastError != "" && r.LastErrorAt.After(at) {
			last, at = r.LastError, r.LastErrorAt
			if len(apis) > 1 {
				last = pv.name + ": " + last
			}
		}
		if pv.refresh.LastError != "" {
			if d := pv.nextTry(now).Sub(now).Round(time.Second); d > 0 && (next == 0 || d < next) {
				next = d
			}
		}
	}
	if last == "" {
		return "provider API has not answered yet", 0
	}
	return last, next
}

// Waiting reports whether the pool, configured to send requests through
// upstream sessions, has none at all yet: no provider's first session
// list came in (its requests get 503). next is the time until the next
// call of a provider's API (0: not known).
func (p *Pool) Waiting() (next time.Duration, waiting bool) {
	if p.st.Load().isDirect || len(p.sessions.Load().list) > 0 {
		return 0, false
	}
	_, next = p.lastProviderError(p.now())
	return next, true
}
