package upstream

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
)

// Bindings is an optional part of a Bus: the fleet's table of sticky keys
// and the sessions they are bound to, so that every instance sends a key
// to one session, even while their session lists differ (one refreshed a
// provider before the others) and after a cooldown moved the key. Both
// calls are compare-and-set in the store, so instances that race agree on
// whoever came first; both keep the binding for ttl from now. What they
// return is untrusted: the pool checks the session before it uses it.
type Bindings interface {
	// Bind returns the session key is bound to, binding it to proposal
	// first when it is bound to none.
	Bind(ctx context.Context, key, proposal string, ttl time.Duration) (string, error)
	// Rebind moves key to `to` if it is bound to `from` (or to none), and
	// returns the session it is bound to now: `to`, or the one another
	// instance moved it to first.
	Rebind(ctx context.Context, key, from, to string, ttl time.Duration) (string, error)
}

// A sticky key's binding lasts bindingTTL in the store from its last use.
// This instance trusts what it last heard for fleetLocalTTL before it asks
// the store again, unless the session can no longer take the key or the
// fleet says the key moved: the hot path pays no round trip per request.
const fleetLocalTTL = 5 * time.Second

// bindingTopic is the bus topic of "this key moved" notes.
const bindingTopic = "binding"

// fleetBindings is the pool's side of the fleet's bindings: the store, a
// short-lived local copy of what it said, and the counters.
type fleetBindings struct {
	store Bindings
	local *bindings // key → session id, for fleetLocalTTL

	lookups, moves, rejected, errors atomic.Int64
}

// bindingName is the store's name of a sticky key.
func bindingName(key uint64) string { return "bind:" + strconv.FormatUint(key, 16) }

// agree makes this instance use the session the fleet bound pr's sticky
// key to, cand being the one it would choose alone (highest priority
// first). The bound session is used when it can take the request and is
// not below cand's priority (a provider that came back takes its keys
// back); else the key moves to cand, unless another instance moved it
// first. When the store cannot be asked, cand serves: the fleet
// degrades to each instance's own choice, which agrees while the session
// lists do.
//
// skip lists the sessions this request tried already. A bound session among
// them that is still fit to serve (it failed this request without a
// cooldown: the origin's 500, a target its gateway could not reach) keeps
// the key: this attempt goes to cand, and the next request goes back. So
// does a bound session that sits out the request's site alone (siteCool).
func (p *Pool) agree(ctx context.Context, pr *pickReq, cand *session, ok func(*session) bool, skip []*session) *session {
	fb := p.fleet
	now := p.now().UnixNano()
	fits := func(s *session) bool {
		return s != nil && ok(s) && s.prov.Load().priority >= cand.prov.Load().priority
	}
	name := bindingName(pr.sticky)
	from, known := fb.local.get(pr.sticky, now)
	if known {
		if s := p.sessions.Load().byID[from]; fits(s) {
			return s
		}
	} else {
		fb.lookups.Add(1)
		id, err := fb.store.Bind(ctx, name, cand.id, bindingTTL)
		if err != nil {
			fb.errors.Add(1)
			return cand
		}
		s, final := p.boundSession(ctx, id)
		if fits(s) {
			fb.local.put(pr.sticky, s.id, now)
			return s
		}
		if s == nil && !final {
			// Maybe a session this instance has not listed yet: leave
			// the binding to the instances that know it.
			return cand
		}
		from = id
	}
	if b := p.sessions.Load().byID[from]; b != nil && b.prov.Load().priority >= cand.prov.Load().priority {
		if slices.Contains(skip, b) && usable(b, pr, now, nil, false) {
			return cand // a detour for this retry only
		}
		if b.h.siteCooling(pr.site, now) {
			// It sits out this request's site alone (its 429 or ban):
			// the key stays, for every other site; this one goes to cand
			// until then.
			elsewhere := *pr
			elsewhere.site = ""
			if usable(b, &elsewhere, now, nil, false) {
				return cand
			}
		}
	}
	fb.lookups.Add(1)
	id, err := fb.store.Rebind(ctx, name, from, cand.id, bindingTTL)
	if err != nil {
		fb.errors.Add(1)
		return cand
	}
	if id == cand.id {
		fb.moves.Add(1)
		fb.local.put(pr.sticky, id, now)
		p.publishMove(pr.sticky, id)
		if p.log.Enabled(ctx, slog.LevelDebug) {
			p.log.Debug("sticky key moved", "key", name, "from", from, "to", id)
		}
		return cand
	}
	// Another instance moved it first: follow, if this instance can.
	if s, _ := p.boundSession(ctx, id); s != nil && ok(s) {
		fb.local.put(pr.sticky, s.id, now)
		return s
	}
	return cand
}

// boundSession is the session a binding read from the store names, nil
// when this instance does not have it. A valid id it does not know may be
// a session another instance listed first: the provider it would belong
// to is asked for its list (at most once per minRefetch for such ids)
// before the binding is given up on. final says the binding names no
// session this instance can have (an invalid id, or one still unknown
// after asking): the key may be moved away from it. Bindings that name no
// session here are counted.
func (p *Pool) boundSession(ctx context.Context, id string) (s *session, final bool) {
	if s := p.sessions.Load().byID[id]; s != nil {
		return s, true
	}
	p.fleet.rejected.Add(1)
	if clientinfo.ValidateSessionID(id) != nil {
		p.log.Debug("ignored a binding from the fleet store: not a session id", "session", clip(id, 80))
		return nil, true
	}
	final = true
	for _, pv := range p.st.Load().apiGroups() {
		if pv.qualify && !strings.HasPrefix(id, pv.name+".") {
			continue
		}
		if !p.refreshSoon(ctx, pv) {
			final = false // not asked: maybe next time
			continue
		}
		if s := p.sessions.Load().byID[id]; s != nil {
			p.fleet.rejected.Add(-1) // it was one after all
			return s, true
		}
	}
	p.log.Debug("ignored a binding from the fleet store: no such session here", "session", clip(id, 80), "final", final)
	return nil, final
}

// moveNote is a "binding" note: key moved to session S.
type moveNote struct {
	Key     string `json:"key"`
	Session string `json:"session"`
}

// publishMove tells the other instances that key now goes to id, so that
// they drop what they heard before fleetLocalTTL runs out.
func (p *Pool) publishMove(key uint64, id string) {
	if p.bus == nil {
		return
	}
	b, err := json.Marshal(moveNote{Key: strconv.FormatUint(key, 16), Session: id})
	if err == nil {
		p.bus.Publish(bindingTopic, "", string(b), 0)
	}
}

// hearMove is the handler of "binding" notes: untrusted, checked whole.
func (p *Pool) hearMove(msg string, _ time.Duration) {
	defer func() {
		if r := recover(); r != nil {
			p.notesRejected.Add(1)
			p.log.Error("panic while applying a binding note from the fleet; ignored", "panic", r, "stack", string(debug.Stack()))
		}
	}()
	key, id, err := decodeMoveNote(msg)
	if err != nil {
		p.notesRejected.Add(1)
		p.log.Debug("ignored a binding note from the fleet", "err", err, "note", clip(msg, 200))
		return
	}
	if p.fleet == nil {
		return
	}
	if p.sessions.Load().byID[id] == nil {
		// Not a session here (yet): forget what we heard, ask the store.
		p.fleet.local.drop(key)
		return
	}
	p.fleet.local.put(key, id, p.now().UnixNano())
}

func decodeMoveNote(msg string) (uint64, string, error) {
	var n moveNote
	if len(msg) > maxNote {
		return 0, "", fmt.Errorf("%w: %d bytes", errNote, len(msg))
	}
	if err := json.Unmarshal([]byte(msg), &n); err != nil {
		return 0, "", fmt.Errorf("%w: %v", errNote, err)
	}
	key, err := strconv.ParseUint(n.Key, 16, 64)
	if err != nil || key == 0 {
		return 0, "", fmt.Errorf("%w: key %q", errNote, clip(n.Key, 40))
	}
	if err := clientinfo.ValidateSessionID(n.Session); err != nil {
		return 0, "", fmt.Errorf("%w: %v", errNote, err)
	}
	return key, n.Session, nil
}

// drop forgets key.
func (b *bindings) drop(key uint64) {
	sh := b.shard(key)
	sh.mu.Lock()
	delete(sh.cur, key)
	delete(sh.old, key)
	sh.mu.Unlock()
}

// BindingStats counts the pool's use of the fleet's bindings.
type BindingStats struct {
	// Lookups are round trips to the store (Bind and Rebind); Moves the
	// keys this instance moved to another session; Rejected the bindings
	// read back that named no session this instance has; Errors the
	// lookups that failed (the store away).
	Lookups, Moves, Rejected, Errors int64
}

// BindingStats reports the fleet bindings' counters (zero without a
// store that keeps bindings).
func (p *Pool) BindingStats() BindingStats {
	if p.fleet == nil {
		return BindingStats{}
	}
	f := p.fleet
	return BindingStats{Lookups: f.lookups.Load(), Moves: f.moves.Load(), Rejected: f.rejected.Load(), Errors: f.errors.Load()}
}
