package upstream

import (
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// outcome is what one use of a session says about it.
type outcome uint8

const (
	// outcomeNone says nothing about the session: the client or the flight
	// gave up, or the origin's certificate is bad whatever the exit IP.
	outcomeNone outcome = iota
	outcomeOK
	// outcomeRateLimited is a 429, from the origin or the gateway.
	outcomeRateLimited
	// outcomeBanned is a ban signal of a rule (status or body).
	outcomeBanned
	// outcomeConnError is a failure to reach the origin through the
	// session: dial, CONNECT/SOCKS refusal, timeout, reset.
	outcomeConnError
	// outcomeServerError is a 5xx: most likely the origin's trouble, not
	// the exit IP's, hence the mild penalty.
	outcomeServerError
)

var outcomeNames = [...]string{"none", "ok", "rate_limited", "banned", "connection_error", "server_error"}

func (o outcome) String() string {
	if int(o) < len(outcomeNames) {
		return outcomeNames[o]
	}
	return "outcome(" + strconv.Itoa(int(o)) + ")"
}

// parseOutcome is String's inverse.
func parseOutcome(name string) (outcome, bool) {
	for i, n := range outcomeNames {
		if n == name {
			return outcome(i), true
		}
	}
	return outcomeNone, false
}

// failure reports whether o counts against the session.
func (o outcome) failure() bool { return o >= outcomeRateLimited }

// penalty is what one failure costs a session. The numbers follow the
// usual rotating-pool practice: a 429 says "this IP, right now" (short
// cooldown), a connection error says "this gateway/session is broken"
// (long cooldown), a 5xx is usually the origin's (no cooldown).
type penalty struct {
	weight   int
	cooldown time.Duration
}

var penalties = [...]penalty{
	outcomeRateLimited: {weight: 2, cooldown: 60 * time.Second},
	outcomeBanned:      {weight: 2, cooldown: 60 * time.Second},
	outcomeConnError:   {weight: 3, cooldown: 300 * time.Second},
	outcomeServerError: {weight: 1, cooldown: 0},
}

const (
	// escalateAfter consecutive failures (429s, bans, connection errors;
	// not the origin's 5xx) put a session out for escalatedCooldown: it
	// keeps failing, stop spending requests on it.
	escalateAfter     = 3
	escalatedCooldown = 10 * time.Minute
	// maxRetryAfter caps how long an origin's Retry-After can bench a
	// session: a bogus "Retry-After: 31536000" must not lose it for a year.
	maxRetryAfter = time.Hour
)

// health is the passive and active health state of one session. Marks take
// mu (one small lock per session, never held across I/O); selection, the
// hot path, reads only the atomic mirrors.
type health struct {
	mu         sync.Mutex // guards the fields up to lastAt
	weight     int
	failures   int // consecutive
	coolUntil  time.Time
	coolReason outcome
	last       outcome
	lastErr    string
	lastAt     time.Time
	// coolEpoch counts the cooldowns started or extended, the sites'
	// too: an attempt notes it when it starts (epoch), so that its
	// outcome can tell a cooldown that began while it was in flight (see
	// markSince).
	coolEpoch uint64
	// sites are the cooldowns of one site each (see siteCool), at most
	// maxSites; sitesDirty says publish must rebuild aSites.
	sites      map[string]siteCool
	sitesDirty bool

	// Mirrors for lock-free reads, written under mu.
	aWeight    atomic.Int32
	aCoolUntil atomic.Int64 // unix nanoseconds; 0 = not cooling
	aEpoch     atomic.Uint64
	// aSites maps a cooling site to the end of its cooldown (unix
	// nanoseconds); nil when none cools, which is what selection meets
	// nearly always.
	aSites atomic.Pointer[map[string]int64]

	requests  atomic.Int64 // uses with an outcome
	failed    atomic.Int64 // of which failures
	rotations atomic.Int64 // new exit IPs through the provider API
}

func (h *health) init(weight int) {
	h.mu.Lock()
	h.weight = weight
	h.aWeight.Store(int32(weight))
	h.mu.Unlock()
}

// siteCool is the cooldown of a session at one site (a host): a 429 or a
// ban from an origin says "this exit IP, at this site, right now", and
// nothing of the IP at any other site. Benched for all of them, the pool
// stopped serving every site as soon as one of them limited everyone (a
// site-wide rate limit: one request rotated and benched every session).
type siteCool struct {
	until   time.Time
	reason  outcome
	strikes int // walls in a row at this site: escalateAfter of them escalate
}

// validSite reports whether host is a site as siteOf writes it: a
// lower-case host name or address and a port, at most 260 bytes.
func validSite(host string) bool {
	if len(host) > 260 {
		return false
	}
	for i := 0; i < len(host); i++ {
		switch c := host[i]; {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '.', c == '-', c == '_', c == ':':
		default:
			return false
		}
	}
	return true
}

// siteOf is the site of a request to host and port: "host:port", the
// host in lower case. A port is part of it, as of a web origin.
func siteOf(host, port string) string { return strings.ToLower(host) + ":" + port }

// urlSite is siteOf for a request URL, its port defaulted by scheme.
func urlSite(u *url.URL) string {
	port := u.Port()
	if port == "" {
		port = "80"
		if u.Scheme == "https" {
			port = "443"
		}
	}
	return siteOf(u.Hostname(), port)
}

// maxSites bounds the sites a session keeps cooldowns for; past it the
// one ending first makes room.
const maxSites = 1024

// publish copies weight and cooldowns to the atomic mirrors. Caller holds mu.
func (h *health) publish() {
	h.aWeight.Store(int32(h.weight))
	h.aEpoch.Store(h.coolEpoch)
	if h.coolUntil.IsZero() {
		h.aCoolUntil.Store(0)
	} else {
		h.aCoolUntil.Store(h.coolUntil.UnixNano())
	}
	if h.sitesDirty {
		h.sitesDirty = false
		if len(h.sites) == 0 {
			h.aSites.Store(nil)
			return
		}
		m := make(map[string]int64, len(h.sites))
		for host, c := range h.sites {
			m[host] = c.until.UnixNano()
		}
		h.aSites.Store(&m)
	}
}

// siteCooling reports whether the session sits out host at now (unix
// nanos).
func (h *health) siteCooling(host string, now int64) bool {
	m := h.aSites.Load()
	if m == nil || host == "" {
		return false
	}
	u, ok := (*m)[host]
	return ok && u > now
}

// benchSite records c, the cooldown at host, extended to until (never
// shortened), and reports whether it was extended. Caller holds mu and
// publishes.
func (h *health) benchSite(host string, c siteCool, until time.Time, reason outcome, now time.Time) bool {
	extend := until.After(c.until)
	if extend {
		c.until, c.reason = until, reason
	}
	if _, ok := h.sites[host]; !ok {
		if !extend {
			return false
		}
		h.makeRoomForSite(now)
	}
	if h.sites == nil {
		h.sites = make(map[string]siteCool)
	}
	h.sites[host] = c
	if extend {
		h.sitesDirty = true
		h.coolEpoch++
	}
	return extend
}

// makeRoomForSite drops the sites whose cooldown is over and, at
// maxSites still, the one ending first. Caller holds mu.
func (h *health) makeRoomForSite(now time.Time) {
	if len(h.sites) < maxSites {
		return
	}
	first := ""
	for host, c := range h.sites {
		if !now.Before(c.until) {
			delete(h.sites, host)
			continue
		}
		if first == "" || c.until.Before(h.sites[first].until) {
			first = host
		}
	}
	if len(h.sites) >= maxSites {
		delete(h.sites, first)
	}
	h.sitesDirty = true
}

// epoch is the cooldown epoch an attempt starting now notes (see markSince).
func (h *health) epoch() uint64 { return h.aEpoch.Load() }

// mark records one outcome at now of an attempt that started after every
// cooldown so far (see markSince), for the session as a whole.
func (h *health) mark(o outcome, now time.Time, retryAfter time.Duration, errMsg string) (cooling time.Duration) {
	return h.markSince(o, now, retryAfter, errMsg, h.epoch(), "", false)
}

// sited reports whether o, as an origin's answer, speaks of the exit IP at
// that origin's site alone (see siteCool).
func (o outcome) sited() bool { return o == outcomeRateLimited || o == outcomeBanned }

// markSince records one outcome at now of an attempt that started at
// cooldown epoch since. retryAfter (from a 429 or ban) makes the cooldown
// at least that long. A cooldown is never shortened by a later, milder
// failure; a success ends it (the session demonstrably works), unless the
// attempt started before the cooldown did. site is the site the attempt
// went to ("" none known): a cooldown there that began after the attempt
// makes its outcome the same wall, whatever the outcome (the tunnels a
// rotation after a site's 429 cut included). scoped says the outcome is
// the site's own answer: a 429 or a ban then benches the session at that
// site alone (siteCool), and a success there ends that. It returns the
// cooldown this mark started or extended (0: none), for the fleet to hear
// about: the site's when the mark is scoped and sited, the session's
// otherwise.
func (h *health) markSince(o outcome, now time.Time, retryAfter time.Duration, errMsg string, since uint64, site string, scoped bool) (cooling time.Duration) {
	if o == outcomeNone {
		return 0
	}
	h.requests.Add(1)
	if o.failure() {
		h.failed.Add(1)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.last, h.lastAt, h.lastErr = o, now, errMsg
	sc, atSite := h.sites[site], scoped && site != "" && o.sited()
	if site == "" {
		sc = siteCool{}
	}
	if since != h.coolEpoch && (now.Before(h.coolUntil) || now.Before(sc.until)) {
		// The request was sent before the cooldown began. Its 200 says
		// nothing about the exit IP since the 429 (or the fleet's news):
		// many requests share a session, and were the ones admitted
		// before a rate limit to end its cooldown as they come back, the
		// session would never sit one out. Its failure is the wall that
		// began the cooldown, met by every request in flight at once (or
		// a tunnel the rotation after it cut), not one more: counted
		// each, ten requests in flight at a 429 benched the session for
		// escalatedCooldown, its new exit IP with it. It may still ask
		// for a longer cooldown by a Retry-After of its own.
		if o.failure() && retryAfter > 0 {
			cool := min(retryAfter, maxRetryAfter)
			if atSite && h.benchSite(site, sc, now.Add(cool), o, now) || !atSite && h.benchUntil(now.Add(cool), o) {
				cooling = cool
				h.publish()
			}
		}
		return cooling
	}
	if o == outcomeOK {
		h.weight = min(h.weight+1, maxWeight)
		h.failures = 0
		h.coolUntil, h.coolReason = time.Time{}, outcomeNone
		if _, ok := h.sites[site]; ok && site != "" && scoped {
			delete(h.sites, site)
			h.sitesDirty = true
		}
		h.publish()
		return 0
	}
	p := penalties[o]
	h.weight = max(h.weight-p.weight, minWeight)
	if atSite {
		sc.strikes++
		cool := max(p.cooldown, min(retryAfter, maxRetryAfter))
		if sc.strikes >= escalateAfter && escalatedCooldown > cool {
			cool = escalatedCooldown
		}
		if h.benchSite(site, sc, now.Add(cool), o, now) {
			cooling = cool
		}
		h.publish()
		return cooling
	}
	if o != outcomeServerError {
		// A 5xx is the origin's trouble, not the exit IP's: a site that
		// is down answers every session so. Were it counted, three of
		// them escalated each session in turn to escalatedCooldown, and
		// one dead site took the pool out for every other one.
		h.failures++
	}
	cool := p.cooldown
	if retryAfter > cool {
		cool = min(retryAfter, maxRetryAfter)
	}
	reason := o
	if h.failures >= escalateAfter && escalatedCooldown > cool {
		cool = escalatedCooldown
	}
	if cool > 0 && h.benchUntil(now.Add(cool), reason) {
		cooling = cool
	}
	h.publish()
	return cooling
}

// benchUntil extends the cooldown to until, never shortening it, and
// reports whether it did. Caller holds mu and publishes.
func (h *health) benchUntil(until time.Time, reason outcome) bool {
	if !until.After(h.coolUntil) {
		return false
	}
	h.coolUntil, h.coolReason = until, reason
	h.coolEpoch++
	return true
}

// coolFor applies a cooldown another instance of the fleet started, at
// site ("": the session's own): it benches the session as long, but says
// nothing about this instance's own requests (weight and failures stay as
// they are). It reports whether the cooldown was extended.
func (h *health) coolFor(d time.Duration, reason outcome, now time.Time, site string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if d <= 0 {
		return false
	}
	until := now.Add(min(d, maxRetryAfter))
	if site != "" && !h.benchSite(site, h.sites[site], until, reason, now) || site == "" && !h.benchUntil(until, reason) {
		return false
	}
	h.publish()
	return true
}

// sitesCooling counts the sites the session sits out at now.
func (h *health) sitesCooling(now time.Time) int {
	m := h.aSites.Load()
	if m == nil {
		return 0
	}
	n := 0
	for _, u := range *m {
		if u > now.UnixNano() {
			n++
		}
	}
	return n
}

// coolingSites are the sites the session sits out at now, the first
// limit of them by host, for the admin API.
func (h *health) coolingSites(now time.Time, limit int) []SiteCooldown {
	h.mu.Lock()
	var out []SiteCooldown
	for host, c := range h.sites {
		if now.Before(c.until) {
			out = append(out, SiteCooldown{Host: host, Until: c.until, Remaining: c.until.Sub(now).Round(time.Second).String(), Reason: c.reason.String()})
		}
	}
	h.mu.Unlock()
	slices.SortFunc(out, func(a, b SiteCooldown) int { return strings.Compare(a.Host, b.Host) })
	if len(out) > limit {
		out = out[:limit]
	}
	return out
}

// available reports whether the session may be chosen at now (unix nanos).
func (h *health) available(now int64) bool {
	u := h.aCoolUntil.Load()
	return u == 0 || u <= now
}

// currentWeight is the health weight, 1-10.
func (h *health) currentWeight() int { return int(h.aWeight.Load()) }

// coolingForOrigin reports whether the session sits out a 429 or a ban. An
// active probe of another URL cannot tell that the origin forgave the IP,
// so such sessions are not probed (a probe success would end the cooldown).
func (h *health) coolingForOrigin(now time.Time) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return now.Before(h.coolUntil) && (h.coolReason == outcomeRateLimited || h.coolReason == outcomeBanned)
}

// healthSnapshot is a consistent copy for the admin API.
type healthSnapshot struct {
	weight     int
	failures   int
	coolUntil  time.Time
	coolReason outcome
	last       outcome
	lastErr    string
	lastAt     time.Time
}

func (h *health) snapshot() healthSnapshot {
	h.mu.Lock()
	defer h.mu.Unlock()
	return healthSnapshot{h.weight, h.failures, h.coolUntil, h.coolReason, h.last, h.lastErr, h.lastAt}
}
