package upstream

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"runtime/debug"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
)

// Bus carries notes between the proxy instances that drive the same
// upstream sessions (the shared store's events channel in production).
// Without one each instance learns alone: a session rate-limited through
// one instance keeps being sent requests by the others until each has
// collected its own 429, and a rotation made by one leaves the others on
// tunnels to the old exit IP.
//
// What arrives over a Bus is untrusted input: another version of onceproxy,
// a person with redis-cli or a bug may have written it. The pool checks
// every note before it acts on it and ignores what it cannot read.
type Bus interface {
	// Publish sends msg on topic to the other instances. With ttl > 0 the
	// note is lasting: the bus keeps it under key for ttl (a later note on
	// key replaces it unless it would end sooner) and hands it to
	// instances that subscribe later or reconnect. It must not block: a
	// note that cannot be sent is dropped.
	Publish(topic, key, msg string, ttl time.Duration)
	// Subscribe makes f receive the notes other instances publish on
	// topic: live notes as they arrive (left is 0), and the lasting notes
	// that still hold (left is what is left of them), once before
	// Subscribe returns and again each time the bus reconnects after an
	// outage. f must be quick.
	Subscribe(topic string, f func(msg string, left time.Duration))
}

// Claimer is an optional part of a Bus: it makes one instance at a time
// rotate a session. When many instances hit the same 429 at once, each
// would otherwise call the provider's rotate API (paid, rate-limited, and
// every extra rotation throws away the fresh IP the previous one got).
type Claimer interface {
	// Claim makes this instance the only holder of name for ttl. ok is
	// false when another instance holds it; release gives it up early (a
	// rotation that failed). A bus that cannot tell (its store is away)
	// says ok: rotating twice beats not rotating.
	Claim(ctx context.Context, name string, ttl time.Duration) (release func(), ok bool)
}

// WithBus shares cooldowns and rotations with the other instances of a
// fleet over b. A b that is also a Claimer makes one instance rotate a
// session at a time.
func WithBus(b Bus) Option {
	return func(o *options) { o.bus = b }
}

// sessionTopic is the bus topic of upstream session news.
const sessionTopic = "session"

// SessionEvent is one piece of session news, as it travels between
// instances (JSON). Instances of different versions share it: fields are
// only ever added, and an instance ignores what it does not know.
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
	// Host is the site a cooldown is for (an origin's 429 or ban); ""
	// for the session as a whole.
	Host string `json:"host,omitempty"`
}

// The kinds of SessionEvent.
const (
	EventCooldown = "cooldown"
	EventRotated  = "rotated"
)

// maxNote bounds a session note: real ones are under 200 bytes.
const maxNote = 4 << 10

// errNote marks a note the pool could not use.
var errNote = errors.New("session note rejected")

// decodeSessionEvent reads and checks one note. left > 0 is what is left of
// a recalled lasting note; it replaces the note's own duration. Everything
// it accepts can be applied without further checks.
func decodeSessionEvent(msg string, left time.Duration) (SessionEvent, error) {
	var ev SessionEvent
	if len(msg) > maxNote {
		return ev, fmt.Errorf("%w: %d bytes, over %d", errNote, len(msg), maxNote)
	}
	if err := json.Unmarshal([]byte(msg), &ev); err != nil {
		return ev, fmt.Errorf("%w: %v", errNote, err)
	}
	if err := clientinfo.ValidateSessionID(ev.Session); err != nil {
		return ev, fmt.Errorf("%w: %v", errNote, err)
	}
	switch ev.Kind {
	case EventCooldown:
		if left != 0 {
			ev.For = left
		}
		// A cooldown here never lasts longer than maxRetryAfter: a longer
		// one is nobody's cooldown.
		if ev.For <= 0 || ev.For > maxRetryAfter {
			return ev, fmt.Errorf("%w: cooldown of %s is outside (0, %s]", errNote, ev.For, maxRetryAfter)
		}
		if o, ok := parseOutcome(ev.Reason); !ok || !o.failure() {
			return ev, fmt.Errorf("%w: %q is not a failure outcome", errNote, ev.Reason)
		}
		if ev.Host != "" && !validSite(ev.Host) {
			return ev, fmt.Errorf("%w: host %q is not a host name or address", errNote, clip(ev.Host, 64))
		}
	case EventRotated:
		if ev.ExitIP != "" {
			if _, err := netip.ParseAddr(ev.ExitIP); err != nil {
				return ev, fmt.Errorf("%w: exit_ip %q is not an IP address", errNote, ev.ExitIP)
			}
		}
	default:
		return ev, fmt.Errorf("%w: unknown kind %q", errNote, ev.Kind)
	}
	return ev, nil
}

// publish tells the fleet about ev. A cooldown is lasting: instances that
// start later, or come back after an outage, still hear about it.
func (p *Pool) publish(ev SessionEvent) {
	if p.bus == nil {
		return
	}
	b, err := json.Marshal(ev)
	if err != nil {
		return
	}
	key, ttl := "", time.Duration(0)
	if ev.Kind == EventCooldown {
		// One lasting note per session, and per site of a session: a
		// site's must not replace the session's own, nor another site's.
		key, ttl = ev.Session, ev.For
		if ev.Host != "" {
			key += "@" + ev.Host
		}
	}
	p.bus.Publish(sessionTopic, key, string(b), ttl)
}

// hear is the pool's Subscribe handler: news from another instance.
func (p *Pool) hear(msg string, left time.Duration) {
	defer func() {
		// Nothing another instance writes may take this one down. The
		// decoder is fuzzed without this net, which is the real test.
		if r := recover(); r != nil {
			p.notesRejected.Add(1)
			p.log.Error("panic while applying a session note from the fleet; ignored",
				"panic", r, "stack", string(debug.Stack()))
		}
	}()
	ev, err := decodeSessionEvent(msg, left)
	if err != nil {
		p.notesRejected.Add(1)
		p.log.Debug("ignored a session note from the fleet", "err", err, "note", clip(msg, 200))
		return
	}
	p.applySessionEvent(ev)
}

// NotesRejected counts the session notes from the fleet that were ignored
// because they could not be read.
func (p *Pool) NotesRejected() int64 { return p.notesRejected.Load() }

func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// rotationQuiet is how long a rotation's claim is kept after it succeeded:
// 429s still arriving from the old exit IP (requests sent before the
// rotation) must not rotate the new one away.
const rotationQuiet = 5 * time.Second

// claimRotation is rotateAfterFailure's fleet step, for an attempt made at
// rotation generation gen. It reports whether this instance should call
// the rotate API; when it should not, rotated says whether the session
// got a new exit IP meanwhile (another instance's rotation, heard as news).
func (p *Pool) claimRotation(ctx context.Context, s *session, gen uint64, pv *provider) (proceed bool, release func(), rotated bool) {
	c, ok := p.bus.(Claimer)
	if !ok {
		return true, func() {}, false
	}
	release, ok = c.Claim(ctx, "rotate:"+s.id, rotationQuiet+pv.cfg.Timeout)
	if ok {
		return true, release, false
	}
	// Another instance is rotating: wait for its news, as long as a
	// rotation may take.
	wait, cancel := context.WithTimeout(ctx, pv.cfg.Timeout)
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

// mark records an outcome of s, for an attempt that started at s's
// cooldown epoch since (s.h.epoch()), and tells the fleet when it benched s.
func (p *Pool) mark(s *session, since uint64, o outcome, retryAfter time.Duration, msg, site string, scoped bool) {
	if d := s.h.markSince(o, p.now(), retryAfter, msg, since, site, scoped); d > 0 {
		ev := SessionEvent{Session: s.id, Kind: EventCooldown, For: d, Reason: o.String()}
		if scoped && o.sited() {
			ev.Host = site
		}
		p.publish(ev)
		if ev.Host == "" {
			p.checkProviders()
		}
	}
}

// gatewayOutcome records what an attempt says about s's gateway (s itself
// is marked as usual). A gateway that could not be reached is benched with
// every session behind it: the others are not tried one by one while
// another provider can serve. Any answer from the gateway ends that.
func (p *Pool) gatewayOutcome(s *session, v verdict, err error) {
	switch {
	case v.kind == outcomeNone:
	case v.gateway:
		if s.gw.refused(p.now()) {
			p.log.Warn("upstream gateway refuses connections: its sessions sit out", "provider", s.prov.Load().name,
				"gateway", s.gw.addr, "until", time.Unix(0, s.gw.downUntil.Load()).Format(time.TimeOnly), "err", s.scrub(err.Error()))
			p.checkProviders()
		}
	default:
		if s.gw.answered() {
			p.log.Info("upstream gateway answering again", "provider", s.prov.Load().name, "gateway", s.gw.addr)
			p.checkProviders()
		}
	}
}

// applySessionEvent applies checked news from another instance: a
// cooldown benches the session here too; a rotation means the tunnels this
// instance keeps through the session lead to the old exit IP, so they are
// closed, and flights that failed before it count it as their rotation.
// Unknown sessions (not in this instance's list yet) are ignored.
func (p *Pool) applySessionEvent(ev SessionEvent) {
	s := p.sessions.Load().byID[ev.Session]
	if s == nil {
		return
	}
	switch ev.Kind {
	case EventCooldown:
		reason, _ := parseOutcome(ev.Reason)
		if s.h.coolFor(ev.For, reason, p.now(), ev.Host) {
			p.log.Info("upstream session cooling down: another instance saw it fail",
				"session", s.id, "outcome", reason.String(), "for", ev.For)
		}
	case EventRotated:
		s.rotatedTo(ev.ExitIP)
		p.log.Info("upstream session rotated by another instance", "session", s.id, "exit_ip", ev.ExitIP)
	}
}
