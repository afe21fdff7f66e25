package upstream

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"
)

// refresh fetches the provider's session list and makes it current. On any
// error the pool keeps the list it has.
func (p *Pool) refresh(ctx context.Context) error {
	specs, err := p.provider.list(ctx)
	p.refreshMu.Lock()
	defer p.refreshMu.Unlock()
	now := p.now()
	if err != nil {
		p.prov.LastError = err.Error()
		p.prov.LastErrorAt = now
		p.prov.Failures++
		return err
	}

	old := p.sessions.Load()
	list := slices.Clone(p.static)
	var added, replaced, skipped []string
	kept := map[*session]bool{}
	for _, spec := range specs {
		if st := old.byID[spec.id]; st != nil && st.source == sourceConfig {
			// A configured session wins over a listed one with its id:
			// the operator wrote it down on purpose.
			skipped = append(skipped, spec.id)
			continue
		}
		prev := old.byID[spec.id]
		if prev != nil && prev.same(spec) {
			prev.setExitIP(spec.exitIP)
			kept[prev] = true
			list = append(list, prev)
			continue
		}
		s, err := p.kit.newSession(spec)
		if err != nil {
			// Cannot happen for a spec that passed list's checks; keep
			// the previous session rather than lose the id.
			p.log.Error("upstream provider session unusable", "session", spec.id, "err", err)
			if prev != nil {
				kept[prev] = true
				list = append(list, prev)
			}
			continue
		}
		if prev != nil {
			// New credentials or mode, same session: its health stays.
			s.h.copyFrom(&prev.h)
			s.rotations.Store(prev.rotations.Load())
			replaced = append(replaced, spec.id)
		} else {
			added = append(added, spec.id)
		}
		list = append(list, s)
	}
	var removed []string
	// Connections of sessions retired by the previous refresh had a whole
	// refresh period to finish: close what is idle now and forget them.
	for _, s := range p.retired {
		s.closeIdle()
	}
	p.retired = p.retired[:0]
	for _, s := range old.list {
		if s.source == sourceProvider && !kept[s] {
			if _, still := findID(list, s.id); !still {
				removed = append(removed, s.id)
			}
			s.closeIdle()
			p.retired = append(p.retired, s)
		}
	}
	sortSessions(list)
	p.sessions.Store(newSessionSet(list))
	p.prov.Sessions = len(list) - len(p.static)
	p.prov.LastRefresh = now
	p.prov.LastError = ""
	if len(added)+len(replaced)+len(removed) > 0 || p.prov.Refreshes == 0 {
		p.log.Info("upstream provider sessions refreshed", "sessions", p.prov.Sessions,
			"added", added, "replaced", replaced, "removed", removed, "shadowed_by_config", skipped)
	}
	p.prov.Refreshes++
	return nil
}

func findID(list []*session, id string) (*session, bool) {
	for _, s := range list {
		if s.id == id {
			return s, true
		}
	}
	return nil, false
}

// retryDelay is how long to wait before the next refresh after the given
// number of consecutive failures: quickly at first (a pool without
// sessions answers 503 meanwhile), backing off to the refresh interval.
func (p *Pool) retryDelay(failures int) time.Duration {
	d := min(5*time.Second, p.cfg.Provider.Refresh)
	for i := 1; i < failures && d < p.cfg.Provider.Refresh; i++ {
		d *= 2
	}
	return min(d, p.cfg.Provider.Refresh)
}

// refreshLoop refreshes the provider's list every provider.refresh, sooner
// after a failure.
func (p *Pool) refreshLoop(ctx context.Context) {
	failures := 0
	p.refreshMu.Lock()
	if p.prov.LastError != "" {
		failures = 1 // the start-up fetch failed
	}
	p.refreshMu.Unlock()
	for {
		wait := p.cfg.Provider.Refresh
		if failures > 0 {
			wait = p.retryDelay(failures)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, p.cfg.Provider.Timeout)
		err := p.refresh(rctx)
		cancel()
		switch {
		case err == nil:
			if failures > 0 {
				p.log.Info("upstream provider API answering again", "sessions", p.ProviderStatus().Sessions)
			}
			failures = 0
		case ctx.Err() != nil:
			return
		default:
			failures++
			n := len(p.sessions.Load().list)
			if n == 0 {
				p.log.Error("upstream provider refresh failed; no sessions yet, requests get 503",
					"err", err, "next_try", p.retryDelay(failures))
			} else {
				p.log.Warn("upstream provider refresh failed; keeping the last good session list",
					"sessions", n, "err", err, "next_try", p.retryDelay(failures))
			}
		}
	}
}

// healthLoop probes every session now and then every health.interval.
func (p *Pool) healthLoop(ctx context.Context) {
	t := time.NewTicker(p.cfg.Health.Interval)
	defer t.Stop()
	for {
		p.healthRound(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// probeParallelism bounds concurrent probes: hundreds of sessions must not
// open hundreds of connections at the same instant.
const probeParallelism = 16

// healthRound probes the sessions in parallel and waits for all probes.
func (p *Pool) healthRound(ctx context.Context) {
	sem := make(chan struct{}, probeParallelism)
	var wg sync.WaitGroup
	now := p.now()
	for _, s := range p.sessions.Load().list {
		if s.h.coolingForOrigin(now) {
			continue
		}
		wg.Go(func() {
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				return
			}
			defer func() { <-sem }()
			p.probe(ctx, s)
		})
	}
	wg.Wait()
}

// probe fetches health.url through s and marks the outcome.
func (p *Pool) probe(ctx context.Context, s *session) {
	pctx, cancel := context.WithTimeout(ctx, p.cfg.Health.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(pctx, http.MethodGet, p.cfg.Health.URL, nil)
	if err != nil {
		return // validated at start-up
	}
	req.Header.Set("User-Agent", "onceproxy-health")
	resp, err := s.transportFor(req, false).RoundTrip(req) // a probe has no client to mirror
	if ctx.Err() != nil {
		// Shutting down: the probe proves nothing.
		if resp != nil {
			resp.Body.Close()
		}
		return
	}
	var v verdict
	if err != nil {
		v = classifyErr(pctx, err)
		if v.kind == outcomeNone && pctx.Err() != nil {
			// The probe's own timeout: the session hangs.
			v = verdict{kind: outcomeConnError, msg: "health probe: " + err.Error()}
		}
	} else {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
		resp.Body.Close()
		switch {
		case resp.StatusCode == http.StatusTooManyRequests:
			v = verdict{kind: outcomeRateLimited, retryAfter: retryAfter(resp.Header.Get("Retry-After"), p.now()), msg: "health probe: " + resp.Status}
		case resp.StatusCode >= 500:
			v = verdict{kind: outcomeServerError, msg: "health probe: " + resp.Status}
		default:
			v = verdict{kind: outcomeOK}
			if ip := exitIPFromBody(body); ip != "" && !s.perRequest {
				s.setExitIP(ip)
			}
		}
	}
	p.mark(s, v.kind, v.retryAfter, s.scrub(v.msg))
	if v.kind.failure() {
		p.log.Warn("upstream health probe failed", "session", s.id, "outcome", v.kind.String(), "detail", s.scrub(v.msg))
	}
}

// exitIPFromBody reads an exit IP from an IP-echo answer: a bare address
// (ipify's default), or JSON {"ip": ...} (ipify) / {"origin": ...} (httpbin).
func exitIPFromBody(b []byte) string {
	t := strings.TrimSpace(string(b))
	if a, err := netip.ParseAddr(t); err == nil {
		return a.String()
	}
	var j struct {
		IP     string `json:"ip"`
		Origin string `json:"origin"`
	}
	if json.Unmarshal(b, &j) != nil {
		return ""
	}
	for _, v := range []string{j.IP, j.Origin} {
		if a, err := netip.ParseAddr(strings.TrimSpace(v)); err == nil {
			return a.String()
		}
	}
	return ""
}

// recycleEvery is how often timed sessions are checked for a due recycle.
const recycleEvery = time.Second

// recycleLoop closes the idle connections of each timed session once per
// rotation interval: a keep-alive connection opened before the provider
// rotated the session would otherwise keep the previous exit IP.
func (p *Pool) recycleLoop(ctx context.Context) {
	t := time.NewTicker(recycleEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := p.now().UnixNano()
		for _, s := range p.sessions.Load().list {
			if s.rotation != RotationTimed {
				continue
			}
			at := s.recycleAt.Load()
			if at == 0 {
				s.recycleAt.CompareAndSwap(0, now+int64(s.interval))
				continue
			}
			if now >= at && s.recycleAt.CompareAndSwap(at, now+int64(s.interval)) {
				s.closeIdle()
			}
		}
	}
}
