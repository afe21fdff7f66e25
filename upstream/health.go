package upstream

import (
	"strconv"
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
	// coolEpoch counts the cooldowns started or extended: an attempt
	// notes it when it starts (epoch), so that its success can tell a
	// cooldown that began while it was in flight (see markSince).
	coolEpoch uint64

	// Mirrors for lock-free reads, written under mu.
	aWeight    atomic.Int32
	aCoolUntil atomic.Int64 // unix nanoseconds; 0 = not cooling
	aEpoch     atomic.Uint64

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

// publish copies weight and cooldown to the atomic mirrors. Caller holds mu.
func (h *health) publish() {
	h.aWeight.Store(int32(h.weight))
	h.aEpoch.Store(h.coolEpoch)
	if h.coolUntil.IsZero() {
		h.aCoolUntil.Store(0)
	} else {
		h.aCoolUntil.Store(h.coolUntil.UnixNano())
	}
}

// epoch is the cooldown epoch an attempt starting now notes (see markSince).
func (h *health) epoch() uint64 { return h.aEpoch.Load() }

// mark records one outcome at now of an attempt that started after every
// cooldown so far (see markSince).
func (h *health) mark(o outcome, now time.Time, retryAfter time.Duration, errMsg string) (cooling time.Duration) {
	return h.markSince(o, now, retryAfter, errMsg, h.epoch())
}

// markSince records one outcome at now of an attempt that started at
// cooldown epoch since. retryAfter (from a 429 or ban) makes the cooldown
// at least that long. A cooldown is never shortened by a later, milder
// failure; a success ends it (the session demonstrably works), unless the
// attempt started before the cooldown did. It returns the cooldown this
// mark started or extended (0: none), for the fleet to hear about.
func (h *health) markSince(o outcome, now time.Time, retryAfter time.Duration, errMsg string, since uint64) (cooling time.Duration) {
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
	if since != h.coolEpoch && now.Before(h.coolUntil) {
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
			if cool := min(retryAfter, maxRetryAfter); h.benchUntil(now.Add(cool), o) {
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
		h.publish()
		return 0
	}
	p := penalties[o]
	h.weight = max(h.weight-p.weight, minWeight)
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

// coolFor applies a cooldown another instance of the fleet started: it
// benches the session as long, but says nothing about this instance's own
// requests (weight and failures stay as they are). It reports whether the
// cooldown was extended.
func (h *health) coolFor(d time.Duration, reason outcome, now time.Time) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if d <= 0 || !h.benchUntil(now.Add(min(d, maxRetryAfter)), reason) {
		return false
	}
	h.publish()
	return true
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
