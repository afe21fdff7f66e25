package upstream

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptrace"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/redact"
)

// fetched is one answer of a provider's session list API.
type fetched struct {
	specs []sessionSpec
	err   error
}

// fetchList asks pv's API for its sessions.
func (p *Pool) fetchList(ctx context.Context, pv *provider) fetched {
	specs, err := pv.client.list(ctx)
	return fetched{specs, err}
}

// refresh fetches pv's session list and makes it current. On any error
// the pool keeps the list it has; after apiDownAfter errors in a row the
// provider is out of the choice until its API answers again.
func (p *Pool) refresh(ctx context.Context, pv *provider) error {
	pv.fetch.Lock()
	defer pv.fetch.Unlock()
	return p.refreshLocked(ctx, pv)
}

// refreshLocked is refresh with pv.fetch held.
func (p *Pool) refreshLocked(ctx context.Context, pv *provider) error {
	f := p.fetchList(ctx, pv)
	p.mu.Lock()
	st := p.st.Load()
	if st.byName[pv.name] != pv {
		// Reconfigured meanwhile: this provider is gone or replaced.
		p.mu.Unlock()
		return f.err
	}
	p.applyList(pv, f, st)
	if f.err == nil {
		p.rebuild(st)
	}
	p.mu.Unlock()
	p.checkProviders()
	return f.err
}

// applyList makes f pv's list (or counts its failure). The caller
// rebuilds the session set. Caller holds p.mu.
func (p *Pool) applyList(pv *provider, f fetched, st *setup) {
	now := p.now()
	if f.err != nil {
		pv.refresh.LastError = f.err.Error()
		pv.refresh.LastErrorAt = now
		pv.refresh.Failures++
		pv.failures++
		if d := apiWait(f.err); d > 0 {
			if len(pv.sessions) == 0 {
				// No list yet: its sessions serve nothing until one
				// comes, and an API that asks for an hour would keep
				// them (all of them, with no other provider) answering
				// 503 for that hour. One call a MaxFirstListWait is no
				// load on any API.
				d = min(d, MaxFirstListWait)
			}
			pv.notBefore.Store(now.Add(d).UnixNano())
		}
		if pv.failures >= apiDownAfter {
			pv.apiDown.Store(true)
		}
		return
	}
	specs := f.specs
	if limit := pv.cfg.MaxSessions; limit > 0 && len(specs) > limit {
		// The first by id: the same sessions on every instance of a
		// fleet (sticky keys' bindings name them), refresh after refresh,
		// whatever order the API answers in.
		specs = slices.SortedFunc(slices.Values(specs), func(a, b sessionSpec) int { return strings.Compare(a.apiID, b.apiID) })[:limit]
		if pv.listed != len(f.specs) {
			p.log.Warn("upstream provider lists more sessions than its max_sessions: using the first by id",
				"provider", pv.name, "listed", len(f.specs), "max_sessions", limit)
		}
	}
	pv.listed = len(f.specs)
	byID := make(map[string]*session, len(pv.sessions))
	for _, s := range pv.sessions {
		byID[s.id] = s
	}
	list := make([]*session, 0, len(specs))
	var added, replaced, skipped []string
	kept := map[*session]bool{}
	for _, spec := range specs {
		spec.id = pv.sessionID(spec.apiID)
		if clientinfo.ValidateSessionID(spec.id) != nil {
			// "NAME." made a listed id too long: not a session we can name.
			skipped = append(skipped, spec.id)
			continue
		}
		if spec.country == "" {
			spec.country = pv.onlyCountry
		}
		spec.prov = pv
		spec.gw = pv.gatewayFor(spec.proxyURL.Host)
		if slices.ContainsFunc(st.static, func(s *session) bool { return s.id == spec.id }) {
			// A configured session wins over a listed one with its id:
			// the operator wrote it down on purpose.
			skipped = append(skipped, spec.id)
			continue
		}
		prev := byID[spec.id]
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
			p.log.Error("upstream provider session unusable", "provider", pv.name, "session", spec.id, "err", err)
			if prev != nil {
				kept[prev] = true
				list = append(list, prev)
			}
			continue
		}
		if prev != nil {
			// New credentials or mode, same session: its health stays.
			s.inherit(prev)
			replaced = append(replaced, spec.id)
		} else {
			added = append(added, spec.id)
		}
		list = append(list, s)
	}
	var removed []string
	for _, s := range pv.sessions {
		if !kept[s] && !slices.ContainsFunc(list, func(n *session) bool { return n.id == s.id }) {
			removed = append(removed, s.id)
		}
	}
	sortSessions(list)
	pv.sessions = list
	if pv.failures > 0 {
		p.log.Info("upstream provider API answering again", "provider", pv.name, "sessions", len(list))
	}
	pv.failures = 0
	pv.apiDown.Store(false)
	pv.notBefore.Store(0) // it answers: what it asked before is over
	pv.refresh.LastRefresh = now
	pv.refresh.LastError = ""
	if len(added)+len(replaced)+len(removed) > 0 || pv.refresh.Refreshes == 0 {
		p.log.Info("upstream provider sessions refreshed", "provider", pv.name, "sessions", len(list),
			"added", added, "replaced", replaced, "removed", removed, "shadowed_by_config", skipped)
	}
	pv.refresh.Refreshes++
}

// MaxFirstListWait is the longest a provider API's Retry-After keeps
// onceproxy from asking again for a provider's first session list (its
// later refusals are honoured up to an hour: the last good list serves
// meanwhile).
const MaxFirstListWait = time.Minute

// nextTry is when the refresh loop calls pv's API next: its refresh
// interval after the last call (sooner after failures), and never before
// the API's Retry-After. Caller holds Pool.mu.
func (pv *provider) nextTry(now time.Time) time.Time {
	last := pv.refresh.LastRefresh
	if pv.refresh.LastErrorAt.After(last) {
		last = pv.refresh.LastErrorAt
	}
	wait := pv.cfg.Refresh
	if pv.failures > 0 {
		wait = retryDelay(pv, pv.failures)
	}
	next := now.Add(wait)
	if !last.IsZero() && last.Before(now) {
		next = last.Add(wait)
	}
	if nb := time.Unix(0, pv.notBefore.Load()); nb.After(next) {
		next = nb
	}
	return next
}

// retryDelay is how long to wait before pv's next refresh after the given
// number of consecutive failures: quickly at first (a provider without
// sessions serves nothing meanwhile), backing off to the refresh interval.
func retryDelay(pv *provider, failures int) time.Duration {
	d := min(5*time.Second, pv.cfg.Refresh)
	for i := 1; i < failures && d < pv.cfg.Refresh; i++ {
		d *= 2
	}
	return min(d, pv.cfg.Refresh)
}

// refreshLoop refreshes pv's list every refresh interval, sooner after a
// failure. The interval runs from the last fetch, not from the loop's
// start: a reload restarts the loop, and reloads more frequent than the
// interval must not keep the list from ever being fetched.
func (p *Pool) refreshLoop(ctx context.Context, pv *provider) {
	for {
		p.mu.Lock()
		next := pv.nextTry(p.now())
		p.mu.Unlock()
		wait := next.Sub(p.now())
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, pv.cfg.Timeout)
		err := p.refresh(rctx, pv)
		cancel()
		switch {
		case err == nil:
		case ctx.Err() != nil:
			return
		default:
			p.mu.Lock()
			n, failures := len(pv.sessions), pv.failures
			next := pv.nextTry(p.now()).Sub(p.now()).Round(time.Second)
			p.mu.Unlock()
			if n == 0 {
				p.log.Error("upstream provider refresh failed; it has no sessions yet",
					"provider", pv.name, "err", err, apiWaitAttr(err), "next_try", next)
			} else {
				p.log.Warn("upstream provider refresh failed; keeping the last good session list",
					"provider", pv.name, "sessions", n, "failures_in_a_row", failures, "err", err, apiWaitAttr(err), "next_try", next)
			}
		}
	}
}

// healthLoop probes every session now and then every health.interval,
// while health.url is set (a reconfiguration may set or clear it).
func (p *Pool) healthLoop(ctx context.Context) {
	for {
		hc := p.st.Load().cfg.Health
		if hc.URL != "" && !p.st.Load().isDirect {
			p.healthRound(ctx, hc)
		}
		t := time.NewTimer(hc.Interval)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		case <-p.healthKick:
			t.Stop()
		}
	}
}

// probeParallelism bounds concurrent probes: hundreds of sessions must not
// open hundreds of connections at the same instant.
const probeParallelism = 16

// healthRound probes the sessions in parallel, waits for all probes, and
// marks their outcomes (settleRound).
func (p *Pool) healthRound(ctx context.Context, hc HealthConfig) {
	sem := make(chan struct{}, probeParallelism)
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		results []probeResult
	)
	now := p.now()
	defer func() {
		wg.Wait()
		if ctx.Err() == nil {
			p.settleRound(hc, results)
		}
	}()
	// The slot is taken before the goroutine starts: a provider listing
	// thousands of sessions must not start thousands of goroutines that
	// only wait.
	// A benched gateway gets one probe a round, through its first session
	// the round meets: every session of a provider may sit behind its
	// one address, and a probe through each would dial the dead address
	// once per session and round.
	canaries := map[*gateway]bool{}
	for _, s := range p.sessions.Load().list {
		if s.h.coolingForOrigin(now) {
			continue
		}
		if g := s.gw; g != nil && g.down(now.UnixNano()) {
			if canaries[g] {
				continue
			}
			canaries[g] = true
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		wg.Go(func() {
			defer func() { <-sem }()
			if r, ok := p.probe(ctx, s, hc); ok {
				mu.Lock()
				results = append(results, r)
				mu.Unlock()
			}
		})
	}
}

// probeResult is one probe's verdict, marked once its round is over.
type probeResult struct {
	s     *session
	since uint64 // the session's cooldown epoch when the probe began
	v     verdict
	// urlsFault: the failure may be health.url's own (it hung, answered
	// 5xx or 429, or the gateway could not reach it), not the session's.
	urlsFault bool
	// site is health.url's; scoped says v is its answer: a 429 benches
	// the session there alone, a success ends that (see siteCool).
	site   string
	scoped bool
}

// settleRound marks a round's outcomes. health.url is meant to be always
// up, but it is one site like any other: when every probe of a round
// failed in a way the URL itself explains, and more than one did, the
// URL is down, not every session, and none is charged. Charged one by
// one, a hanging health.url benched the whole pool every round, and with
// it the traffic to every other site.
func (p *Pool) settleRound(hc HealthConfig, results []probeResult) {
	reached, urlFaults := false, 0
	for _, r := range results {
		reached = reached || r.v.kind == outcomeOK
		if r.urlsFault {
			urlFaults++
		}
	}
	urlDown := !reached && urlFaults > 1
	if urlDown {
		p.log.Warn("upstream health probes failed through every session: health.url looks down; no session charged",
			"url", redact.URL(hc.URL), "sessions", urlFaults, "detail", results[0].s.scrub(results[0].v.msg))
	}
	for _, r := range results {
		if urlDown && r.urlsFault {
			continue
		}
		p.mark(r.s, r.since, r.v.kind, r.v.retryAfter, r.s.scrub(r.v.msg), r.site, r.scoped)
		if r.v.kind.failure() {
			p.log.Warn("upstream health probe failed", "session", r.s.id, "outcome", r.v.kind.String(), "detail", r.s.scrub(r.v.msg))
		}
	}
}

// probe fetches health.url through s and returns the outcome to mark; ok
// is false when there is none (shutting down).
func (p *Pool) probe(ctx context.Context, s *session, hc HealthConfig) (r probeResult, ok bool) {
	since := s.h.epoch()
	pctx, cancel := context.WithTimeout(ctx, hc.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(pctx, http.MethodGet, hc.URL, nil)
	if err != nil {
		return // validated at start-up
	}
	req.Header.Set("User-Agent", "onceproxy-health")
	// Whether the probe got a connection to the URL (through the
	// gateway's CONNECT, for https): a failure before that is the
	// session's, whatever deadline ended it. net/http reports a dial the
	// request's context ended as that context's error alone.
	var connected atomic.Bool
	req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
		GotConn: func(httptrace.GotConnInfo) { connected.Store(true) },
	}))
	// A probe has no client to mirror. s.roundTrip makes a gateway's 407
	// to a plain-http probe the auth failure it is, not a success.
	resp, err := s.roundTrip(s.transportFor(req, false), req)
	if ctx.Err() != nil {
		// Shutting down: the probe proves nothing.
		if resp != nil {
			resp.Body.Close()
		}
		return r, false
	}
	var v verdict
	urlsFault := false
	if err != nil {
		v = classifyErr(pctx, err)
		// The gateway said it could not reach the URL, or set the
		// connection up and then it failed: the URL may be down
		// (settleRound). A gateway that cannot be reached, refused the
		// session or hung at CONNECT is the session's.
		urlsFault = v.target || connected.Load() && (v.unsure || v.kind == outcomeNone)
		if v.target {
			// health.url is the operator's always-up URL: a gateway that
			// cannot reach it is the session's trouble.
			v = verdict{kind: outcomeConnError, msg: "health probe: " + err.Error()}
		}
		if v.kind == outcomeNone && pctx.Err() != nil {
			// The probe's own timeout: the session hangs.
			v = verdict{kind: outcomeConnError, msg: "health probe: " + err.Error()}
		}
		p.gatewayOutcome(s, v, err)
	} else {
		p.gatewayOutcome(s, verdict{kind: outcomeOK}, nil)
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
		resp.Body.Close()
		switch {
		case resp.StatusCode == http.StatusTooManyRequests:
			v = verdict{kind: outcomeRateLimited, retryAfter: retryAfter(resp.Header.Get("Retry-After"), p.now()), msg: "health probe: " + resp.Status}
			urlsFault = true
		case resp.StatusCode >= 500:
			v = verdict{kind: outcomeServerError, msg: "health probe: " + resp.Status}
			urlsFault = true
		default:
			v = verdict{kind: outcomeOK}
			if ip := exitIPFromBody(body); ip != "" && !s.perRequest {
				s.setExitIP(ip)
			}
		}
	}
	return probeResult{s: s, since: since, v: v, urlsFault: urlsFault && v.kind.failure(),
		site: urlSite(req.URL), scoped: resp != nil && err == nil}, true
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

// recycleLoop retires the connections of each timed session once per
// rotation interval: a keep-alive connection opened before the provider
// rotated the session would otherwise keep the previous exit IP. It also
// closes, once they are idle, the connections a rotation left busy.
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
			if s.recycleDue(now) {
				s.renew()
			} else {
				s.net.pruneOld()
			}
		}
		p.direct.pruneOld()
	}
}

// recycleDue reports whether a timed session's connections are due for a
// recycle at now, and if so sets the next one.
func (s *session) recycleDue(now int64) bool {
	if s.rotation != RotationTimed {
		return false
	}
	at := s.recycleAt.Load()
	if at == 0 {
		s.recycleAt.CompareAndSwap(0, now+int64(s.interval))
		return false
	}
	return now >= at && s.recycleAt.CompareAndSwap(at, now+int64(s.interval))
}
