package upstream

import (
	"context"
	"slices"
	"time"
)

// Fleet carries session news between the proxy instances that drive the
// same upstream sessions (a Redis channel in production). Without it each
// instance learns alone: a session rate-limited through one instance keeps
// being sent requests by the others until each has collected its own 429,
// and a rotation made by one leaves the others on tunnels to the old exit
// IP.
type Fleet interface {
	// PublishSession tells the other instances about ev. It must not
	// block: news that cannot be sent is dropped.
	PublishSession(ev SessionEvent)
}

// SessionEvent is one piece of session news.
type SessionEvent struct {
	Session string `json:"session"`
	// Kind is EventCooldown or EventRotated.
	Kind string `json:"kind"`
	// For and Reason describe a cooldown: how long from now (not an
	// instant: the instances' clocks need not agree), and the outcome that
	// caused it (rate_limited, banned, connection_error, server_error).
	For    time.Duration `json:"for,omitempty"`
	Reason string        `json:"reason,omitempty"`
	// ExitIP is the session's new exit IP after a rotation, when known.
	ExitIP string `json:"exit_ip,omitempty"`
}

// RotationLocker is an optional part of a Fleet: it makes one instance at a
// time rotate a session. When many instances hit the same 429 at once,
// each would otherwise call the provider's rotate API (paid, rate-limited,
// and every extra rotation throws away the fresh IP the previous one got).
type RotationLocker interface {
	// LockRotation claims the rotation of session for ttl. ok is false
	// when another instance holds the claim; release gives it up early
	// (a rotation that failed). A fleet that cannot tell (its store is
	// away) says ok: rotating twice beats not rotating.
	LockRotation(ctx context.Context, session string, ttl time.Duration) (release func(), ok bool)
}

// rotationQuiet is how long a rotation's claim is kept after it succeeded:
// 429s still arriving from the old exit IP (requests sent before the
// rotation) must not rotate the new one away.
const rotationQuiet = 5 * time.Second

// claimRotation is rotateAfterFailure's fleet step, for an attempt made at
// rotation generation gen. It reports whether this instance should call
// the rotate API; when it should not, rotated says whether the session
// got a new exit IP meanwhile (another instance's rotation, heard as news).
func (p *Pool) claimRotation(ctx context.Context, s *session, gen uint64) (proceed bool, release func(), rotated bool) {
	l, ok := p.fleet.(RotationLocker)
	if !ok {
		return true, func() {}, false
	}
	release, ok = l.LockRotation(ctx, s.id, rotationQuiet+p.cfg.Provider.Timeout)
	if ok {
		return true, release, false
	}
	// Another instance is rotating: wait for its news, as long as a
	// rotation may take.
	wait, cancel := context.WithTimeout(ctx, p.cfg.Provider.Timeout)
	defer cancel()
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for s.gen.Load() == gen {
		select {
		case <-wait.Done():
			return false, nil, false
		case <-t.C:
		}
	}
	return false, nil, true
}

// The kinds of SessionEvent.
const (
	EventCooldown = "cooldown"
	EventRotated  = "rotated"
)

// WithFleet shares cooldowns and rotations with the other instances of a
// fleet; news from them arrives through Pool.ApplySessionEvent.
func WithFleet(f Fleet) Option {
	return func(o *options) { o.fleet = f }
}

// mark records an outcome of s and tells the fleet when it benched s.
func (p *Pool) mark(s *session, o outcome, retryAfter time.Duration, msg string) {
	if d := s.h.mark(o, p.now(), retryAfter, msg); d > 0 && p.fleet != nil {
		p.fleet.PublishSession(SessionEvent{Session: s.id, Kind: EventCooldown, For: d, Reason: o.String()})
	}
}

// ApplySessionEvent applies news from another instance: a cooldown benches
// the session here too; a rotation means the tunnels this instance keeps
// through the session lead to the old exit IP, so they are closed, and
// flights that failed before it count it as their rotation. Unknown
// sessions (not in this instance's list yet) are ignored.
func (p *Pool) ApplySessionEvent(ev SessionEvent) {
	s := p.sessions.Load().byID[ev.Session]
	if s == nil {
		return
	}
	switch ev.Kind {
	case EventCooldown:
		reason := outcome(slices.Index(outcomeNames[:], ev.Reason))
		if !reason.failure() {
			reason = outcomeRateLimited
		}
		if s.h.coolFor(ev.For, reason, p.now()) {
			p.log.Info("upstream session cooling down: another instance saw it fail",
				"session", s.id, "outcome", reason.String(), "for", ev.For)
		}
	case EventRotated:
		s.rotatedTo(ev.ExitIP)
		p.log.Info("upstream session rotated by another instance", "session", s.id, "exit_ip", ev.ExitIP)
	}
}
