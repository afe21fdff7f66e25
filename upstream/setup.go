package upstream

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
)

// setup is what the configuration makes of the pool, swapped whole by
// Reconfigure: a request reads it once and sees either the old or the new
// one, never a mix.
type setup struct {
	cfg      Config // with defaults
	rules    []*rule
	defRule  *rule
	isDirect bool // nothing configured: every request goes direct
	// groups are the providers and the hand-listed sessions' group,
	// highest priority first; byName indexes them.
	groups []*provider
	byName map[string]*provider
	// rotator rotates hand-listed sessions of the "sessions" group: the
	// only provider with an API, when there is exactly one.
	rotator *provider
	// static are the hand-listed sessions (upstream.url, upstream.sessions).
	static []*session
}

// match returns the first rule matching host (no port) and path.
func (st *setup) match(host, urlPath string) *rule {
	for _, r := range st.rules {
		if r.matches(host, urlPath) {
			return r
		}
	}
	return st.defRule
}

// apiGroups are the groups with an API.
func (st *setup) apiGroups() []*provider {
	var out []*provider
	for _, pv := range st.groups {
		if pv.client != nil {
			out = append(out, pv)
		}
	}
	return out
}

// build makes the setup for cfg (validated, with defaults), keeping from
// old (nil at start) what stays: providers whose API is the same keep
// their sessions and state, hand-listed sessions with the same id and
// settings are kept, and any other session whose id stays keeps its
// health. New providers come back in fresh, to be fetched. Caller holds
// p.mu when old is not nil.
func (p *Pool) build(cfg Config, old *setup) (st *setup, fresh []*provider, err error) {
	st = &setup{cfg: cfg, byName: map[string]*provider{}}
	st.rules, st.defRule = compileRules(cfg)
	st.isDirect = cfg.URL == "" && len(cfg.Sessions) == 0 && len(cfg.apiProviders()) == 0

	staticGroup := newProvider(ProviderConfig{Name: staticName}, false, p.defPrice)
	if old != nil && old.byName[staticName] != nil {
		staticGroup.adopt(old.byName[staticName])
	}
	st.groups = append(st.groups, staticGroup)
	st.byName[staticName] = staticGroup
	qualify := cfg.Provider.API == ""
	for _, pc := range cfg.apiProviders() {
		pv := newProvider(pc, qualify, p.defPrice)
		key := pc.apiKey(p.getenv)
		prev := oldGroup(old, pc.Name)
		switch {
		case prev != nil && prev.sameAPI(pc, key):
			pv.client = prev.client
			pv.adopt(prev)
		default:
			pv.client = newProviderClient(pc, key, p.kit.tls, p.kit.dialer)
			if pv.continues(prev) {
				// The same API called another way (a new key, timeout or
				// protocol): its sessions keep their health and cooldowns
				// until the new client's list replaces them, and stay
				// if that first fetch fails.
				pv.adopt(prev)
			}
			fresh = append(fresh, pv)
		}
		st.groups = append(st.groups, pv)
		st.byName[pv.name] = pv
	}
	if apis := st.apiGroups(); len(apis) == 1 {
		st.rotator = apis[0]
	}

	var specs []sessionSpec
	if cfg.URL != "" {
		u, _ := parseProxyURL(cfg.URL) // validated
		specs = append(specs, sessionSpec{id: defaultSessionID, apiID: defaultSessionID, source: sourceConfig, proxyURL: u,
			rotation: RotationSticky, weight: defaultWeight, prov: staticGroup})
	}
	for _, sc := range cfg.Sessions {
		u, _ := parseProxyURL(sc.URL)
		spec := sessionSpec{id: sc.ID, apiID: sc.ID, source: sourceConfig, proxyURL: u,
			rotation: sc.Rotation, interval: sc.Interval, weight: sc.Weight, prov: staticGroup}
		if sc.Provider != "" {
			spec.prov = st.byName[sc.Provider]
		}
		spec.country, _ = clientinfo.ParseCountry(sc.Country)
		if sc.City != "" {
			spec.city, _ = clientinfo.ParseCity(sc.City)
		}
		specs = append(specs, spec)
	}
	var prevSet *sessionSet
	if old != nil {
		prevSet = p.sessions.Load()
	}
	for _, spec := range specs {
		spec.gw = spec.prov.gatewayFor(spec.proxyURL.Host)
		var prev *session
		if prevSet != nil {
			prev = prevSet.byID[spec.id]
		}
		if prev != nil && prev.source == sourceConfig && prev.same(spec) && prev.prov.Load().name == spec.prov.name {
			// Its group adopted the old group's gateways: prev.gw is spec.gw.
			st.static = append(st.static, prev)
			continue
		}
		s, err := p.kit.newSession(spec)
		if err != nil {
			return nil, nil, fmt.Errorf("upstream: %w", err)
		}
		if prev != nil {
			s.inherit(prev)
		}
		st.static = append(st.static, s)
	}
	sortSessions(st.static)
	sortGroups(st.groups)
	return st, fresh, nil
}

// continues reports whether pv is prev, the provider of the same name in
// the setup being replaced, with the same API: its sessions are pv's until
// pv's API says otherwise.
func (pv *provider) continues(prev *provider) bool {
	return prev != nil && prev.client != nil && pv.cfg.API == prev.cfg.API
}

func oldGroup(old *setup, name string) *provider {
	if old == nil {
		return nil
	}
	return old.byName[name]
}

// adopt takes over the state of prev, the same provider in the setup
// being replaced: its sessions (pointed at pv by the caller's rebuild),
// gateways, refresh status and availability. Caller holds Pool.mu.
func (pv *provider) adopt(prev *provider) {
	pv.sessions = prev.sessions
	pv.gateways = prev.gateways
	pv.refresh = prev.refresh
	pv.failures = prev.failures
	pv.apiDown.Store(prev.apiDown.Load())
	pv.up.Store(prev.up.Load())
	pv.failovers.Store(prev.failovers.Load())
	pv.failbacks.Store(prev.failbacks.Load())
	pv.lastAsked.Store(prev.lastAsked.Load())
	pv.notBefore.Store(prev.notBefore.Load())
}

// inherit carries over what a session replaced under its id (new
// credentials, a new mode, a reconfiguration) must keep: a new password
// does not make a rate-limited IP fresh. The health is shared, not copied:
// a request still running on prev (a 429 that arrives after the reload)
// marks s, and its count is not lost, nor does a scrape between the copy
// and the swap see a counter go back.
func (s *session) inherit(prev *session) {
	s.h = prev.h
}

// rebuild makes the session set of st current: its hand-listed sessions
// and every provider's, each pointed at its group. Sessions that left are
// retired (idle connections closed now and again at the next rebuild;
// requests running on them finish). Caller holds p.mu.
func (p *Pool) rebuild(st *setup) {
	old := p.sessions.Load()
	list := slices.Clone(st.static)
	for _, s := range st.static {
		// A kept session points at its group of the old setup (build
		// kept it only in a group of the same name).
		s.prov.Store(st.byName[s.prov.Load().name])
	}
	seen := map[string]bool{}
	for _, s := range list {
		seen[s.id] = true
	}
	for _, pv := range st.groups {
		kept := pv.sessions[:0:0]
		for _, s := range pv.sessions {
			if seen[s.id] {
				continue // shadowed by a hand-listed session
			}
			seen[s.id] = true
			s.prov.Store(pv)
			kept = append(kept, s)
		}
		list = append(list, kept...)
	}
	sortSessions(list)
	next := newSessionSet(list, st.groups)
	for _, s := range p.retired {
		s.closeIdle()
	}
	p.retired = p.retired[:0]
	if old != nil {
		for _, s := range old.list {
			if next.byID[s.id] != s {
				s.closeIdle()
				p.retired = append(p.retired, s)
			}
		}
	}
	p.sessions.Store(next)
}

// Reconfigure applies a new upstream section while the pool serves: its
// sessions, providers, rules, prices, retry and when_exhausted. Sessions
// that stay (the same id) keep their health and cooldowns; requests in
// flight finish on the sessions they started on. A provider whose API is
// new is asked for its sessions first (bounded by its timeout; on failure
// it starts without and retries, as at start-up). The settings of the
// connections themselves (timeouts, pools, ca_files,
// insecure_skip_verify_hosts) keep the values the pool was built with:
// RestartKeys names them. An invalid cfg is refused whole, changing
// nothing.
func (p *Pool) Reconfigure(cfg Config) error {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(p.getenv); err != nil {
		return fmt.Errorf("upstream: %w", err)
	}
	p.reconfMu.Lock()
	defer p.reconfMu.Unlock()
	cfg = keepRestartKeys(cfg, p.st.Load().cfg)

	p.mu.Lock()
	st, fresh, err := p.build(cfg, p.st.Load())
	p.mu.Unlock()
	if err != nil {
		return err
	}
	// New providers' first lists, fetched before anything changes, so
	// their sessions serve from the moment the setup does.
	lists := make([]fetched, len(fresh))
	var wg sync.WaitGroup
	for i, pv := range fresh {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), pv.cfg.Timeout)
			defer cancel()
			lists[i] = p.fetchList(ctx, pv)
		})
	}
	wg.Wait()

	p.mu.Lock()
	old := p.st.Load()
	// Sessions of kept providers may have been refreshed meanwhile.
	for _, pv := range st.groups {
		if prev := old.byName[pv.name]; pv.continues(prev) {
			pv.sessions, pv.failures, pv.refresh = prev.sessions, prev.failures, prev.refresh
			pv.apiDown.Store(prev.apiDown.Load())
			pv.notBefore.Store(prev.notBefore.Load())
		}
	}
	for i, pv := range fresh {
		p.applyList(pv, lists[i], st)
	}
	p.st.Store(st)
	p.rebuild(st)
	p.mu.Unlock()

	p.bindings.clear() // logical requests' sessions may be gone or moved
	if p.fleet != nil {
		p.fleet.local.clear()
	}
	p.checkProviders()
	select {
	case p.reconf <- struct{}{}:
	default:
	}
	if cfg.Health != old.cfg.Health {
		// The health loop sleeps for the interval it last read: a new
		// URL or interval must not wait for that (an hour, say) to run out.
		select {
		case p.healthKick <- struct{}{}:
		default:
		}
	}
	p.log.Info("upstream reconfigured", "egress", p.Describe())
	return nil
}

// RestartKeys are the upstream keys Reconfigure keeps as the pool was
// built: they shape the connections every session holds.
var RestartKeys = []string{"dial_timeout", "tls_handshake_timeout", "response_header_timeout", "idle_timeout",
	"idle_conn_timeout", "ping_timeout", "max_idle_conns_per_host", "max_idle_conns", "ca_files", "insecure_skip_verify_hosts"}

// keepRestartKeys returns next with the RestartKeys of running.
func keepRestartKeys(next, running Config) Config {
	next.DialTimeout = running.DialTimeout
	next.TLSHandshakeTimeout = running.TLSHandshakeTimeout
	next.ResponseHeaderTimeout = running.ResponseHeaderTimeout
	next.IdleTimeout = running.IdleTimeout
	next.PingTimeout = running.PingTimeout
	next.IdleConnTimeout = running.IdleConnTimeout
	next.MaxIdleConnsPerHost = running.MaxIdleConnsPerHost
	next.MaxIdleConns = running.MaxIdleConns
	next.CAFiles = running.CAFiles
	next.InsecureSkipVerifyHosts = running.InsecureSkipVerifyHosts
	return next
}

// superviseRefresh runs a refresh loop per provider with an API until ctx
// ends, starting and stopping loops as Reconfigure changes the providers.
func (p *Pool) superviseRefresh(ctx context.Context) {
	type loop struct {
		cancel context.CancelFunc
		done   chan struct{}
	}
	loops := map[*provider]loop{}
	stop := func(pv *provider) {
		l := loops[pv]
		l.cancel()
		<-l.done
		delete(loops, pv)
	}
	defer func() {
		for pv := range maps.Clone(loops) {
			stop(pv)
		}
	}()
	for {
		want := map[*provider]bool{}
		for _, pv := range p.st.Load().apiGroups() {
			want[pv] = true
			if _, ok := loops[pv]; !ok {
				lctx, cancel := context.WithCancel(ctx)
				l := loop{cancel: cancel, done: make(chan struct{})}
				loops[pv] = l
				go func() {
					defer close(l.done)
					p.refreshLoop(lctx, pv)
				}()
			}
		}
		for pv := range maps.Clone(loops) {
			if !want[pv] {
				stop(pv)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-p.reconf:
		}
	}
}

// watchProviders re-checks the providers' availability every second:
// cooldowns and a gateway's benching end with time, and that is how a
// provider fails back.
func (p *Pool) watchProviders(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			p.checkProviders()
		}
	}
}
