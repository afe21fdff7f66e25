package app

import (
	"github.com/seed-a3c387e8/onceproxy/internal/metrics"
	"github.com/seed-a3c387e8/onceproxy/mitm"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// upstreamState is what the metrics read of the upstream pool
// (*upstream.Pool); tests count the reads through it.
type upstreamState interface {
	Snapshot() upstream.Snapshot
	HelloCounts() map[string]int64
	BindingStats() upstream.BindingStats
	NotesRejected() int64
}

// registerMetrics exposes the totals the components keep themselves.
func registerMetrics(m *metrics.Metrics, px *proxy.Server, engine *dedup.Engine, ca *mitm.Authority, up upstreamState, shared *shared) {
	m.Gauge("client_connections", "Client connections open now, on the proxy and SOCKS5 ports.",
		func() float64 { return float64(px.ConnStats().Live) })
	m.Counter("connections_shed_total", "Idle client connections closed to make room near proxy.max_conns.",
		func() float64 { return float64(px.ConnStats().Shed) })
	m.Counter("connections_refused_total", "Client connections refused because their client held proxy.max_conns_per_client.",
		func() float64 { return float64(px.ConnStats().Refused) })
	stat := func(f func(dedup.Stats) float64) func() float64 {
		return func() float64 { return f(engine.Stats()) }
	}
	m.Gauge("flights_in_progress", "Upstream fetches others may be waiting on, running now.",
		stat(func(s dedup.Stats) float64 { return float64(s.Flights) }))
	m.Gauge("flights_sharing", "Flights in progress whose clients have their answer while the fleet's store takes it.",
		stat(func(s dedup.Stats) float64 { return float64(s.Sharing) }))
	m.Gauge("flight_waiters", "Requests waiting on a flight (this process), the leader included.",
		stat(func(s dedup.Stats) float64 { return float64(s.Waiters) }))
	m.Gauge("cache_bytes", "Bytes of responses held in the memory cache.",
		stat(func(s dedup.Stats) float64 { return float64(s.Store.Bytes) }))
	m.Gauge("cache_entries", "Responses held in the memory cache.",
		stat(func(s dedup.Stats) float64 { return float64(s.Store.Entries) }))
	m.Counter("cache_evictions_total", "Responses evicted from the memory cache to stay within its size.",
		stat(func(s dedup.Stats) float64 { return float64(s.Store.Evictions) }))
	m.Counter("upstream_requests_total", "Requests the dedup layer sent upstream (misses and bypasses).",
		stat(func(s dedup.Stats) float64 { return float64(s.UpstreamRequests) }))
	m.Counter("upstream_bytes_avoided_total", "Response body bytes served without an upstream request (HIT, COALESCED).",
		stat(func(s dedup.Stats) float64 { return float64(s.BytesAvoided) }))
	m.Register(metrics.NewVec("money_saved_total", "Money not paid upstream: requests avoided times the per-request price plus bytes avoided times the per-GB price (savings.*).",
		true, []string{"currency"}, func(emit func(float64, ...string)) {
			s := engine.Stats()
			emit(s.MoneySaved, s.Currency)
		}))
	m.Register(metrics.NewVec("peer_fetches_total", "Flights that read a body too big for the shared store from the instance downloading it: whole from it (ok), from the origin after all (fallback: the peer could not be asked, refused the token, or failed mid-body), or neither (failed: cut mid-body, not to be asked again).",
		true, []string{"result"}, func(emit func(float64, ...string)) {
			p := engine.Stats().PeerFetches
			emit(float64(p.OK), "ok")
			emit(float64(p.Fallback), "fallback")
			emit(float64(p.Failed), "failed")
		}))
	m.Counter("certificates_minted_total", "Leaf certificates signed by the local CA.",
		func() float64 { return float64(ca.Stats().Mints) })
	m.Gauge("certificates_cached", "Leaf certificates held in memory.",
		func() float64 { return float64(ca.Stats().Cached) })
	// One read of the pool per scrape feeds every metric of its sessions
	// and providers (see upstream.Pool.Snapshot).
	g := metrics.NewGroup(up.Snapshot)
	for _, v := range []struct {
		name, help string
		counter    bool
		value      func(upstream.SessionCounts) float64
	}{
		{"upstream_session_requests_total", "Requests sent through each upstream session.", true,
			func(s upstream.SessionCounts) float64 { return float64(s.Requests) }},
		{"upstream_session_failures_total", "Failed requests (429, ban, 5xx, connection error) per upstream session.", true,
			func(s upstream.SessionCounts) float64 { return float64(s.Failures) }},
		{"upstream_session_weight", "Current health weight (1-10) of each upstream session.", false,
			func(s upstream.SessionCounts) float64 { return float64(s.Weight) }},
		{"upstream_session_available", "1 when the session is usable, 0 while it cools down.", false,
			func(s upstream.SessionCounts) float64 { return boolValue(s.Available) }},
	} {
		g.Add(v.name, v.help, v.counter, []string{"session", "provider"}, func(snap upstream.Snapshot, emit func(float64, ...string)) {
			for _, s := range snap.Sessions {
				emit(v.value(s), s.ID, s.Provider)
			}
		})
	}
	for _, v := range []struct {
		name, help string
		counter    bool
		value      func(upstream.ProviderStatus) float64
	}{
		{"upstream_provider_available", "1 when the provider can take requests, 0 while it cannot (API failing, gateway refusing, every session cooling).", false,
			func(p upstream.ProviderStatus) float64 { return boolValue(p.Available) }},
		{"upstream_provider_sessions", "Sessions each provider has now.", false,
			func(p upstream.ProviderStatus) float64 { return float64(p.Sessions) }},
		{"upstream_provider_ready_sessions", "Sessions of each provider that can take a request now.", false,
			func(p upstream.ProviderStatus) float64 { return float64(p.Ready) }},
		{"upstream_provider_failovers_total", "Times each provider became unavailable and its traffic failed over to the next priority.", true,
			func(p upstream.ProviderStatus) float64 { return float64(p.Failovers) }},
		{"upstream_provider_failbacks_total", "Times each provider became available again and took its traffic back.", true,
			func(p upstream.ProviderStatus) float64 { return float64(p.Failbacks) }},
		{"upstream_provider_refresh_failures_total", "Failed session list refreshes per provider.", true,
			func(p upstream.ProviderStatus) float64 {
				if p.Refresh == nil {
					return 0
				}
				return float64(p.Refresh.Failures)
			}},
	} {
		g.Add(v.name, v.help, v.counter, []string{"provider"}, func(snap upstream.Snapshot, emit func(float64, ...string)) {
			for _, p := range snap.Providers {
				if p.API == "" && p.Sessions == 0 {
					continue // no hand-listed sessions
				}
				emit(v.value(p), p.Name)
			}
		})
	}
	g.Add("upstream_sessions_cooling_ratio", "Share of the upstream sessions cooling down now (0 with no sessions).", false, nil,
		func(snap upstream.Snapshot, emit func(float64, ...string)) {
			ratio := 0.0
			if len(snap.Sessions) > 0 {
				ratio = float64(snap.Cooling) / float64(len(snap.Sessions))
			}
			emit(ratio)
		})
	g.Add("upstream_site_cooldowns", "Upstream sessions sitting out one site each now, after its 429 or ban (a session sitting out two sites counts twice).", false, nil,
		func(snap upstream.Snapshot, emit func(float64, ...string)) { emit(float64(snap.SiteCooldowns)) })
	m.Register(g)
	m.Register(metrics.NewVec("upstream_connections_total", "Origin connections opened, by how their TLS hello was made: mirrored (the client's own), closest (the client's minus what the TLS library cannot complete), go (Go's: requests without a client fingerprint, fingerprint: go, protocol switches).",
		true, []string{"hello"}, func(emit func(float64, ...string)) {
			for _, mode := range []string{"mirrored", "closest", "go"} {
				emit(float64(up.HelloCounts()[mode]), mode)
			}
		}))
	bind := func(f func(upstream.BindingStats) int64) func() float64 {
		return func() float64 { return float64(f(up.BindingStats())) }
	}
	m.Counter("upstream_bindings_lookups_total", "Round trips to the fleet store for sticky keys' sessions (bind, or move after a cooldown).",
		bind(func(s upstream.BindingStats) int64 { return s.Lookups }))
	m.Counter("upstream_bindings_moves_total", "Sticky keys this instance moved to another session (the bound one cooled down, left, or a provider came back).",
		bind(func(s upstream.BindingStats) int64 { return s.Moves }))
	m.Counter("upstream_bindings_rejected_total", "Bindings read back from the fleet store that named no session this instance has (ignored).",
		bind(func(s upstream.BindingStats) int64 { return s.Rejected }))
	m.Counter("upstream_bindings_errors_total", "Sticky key lookups that failed (the store away): the instance chose alone.",
		bind(func(s upstream.BindingStats) int64 { return s.Errors }))
	rejected := func() float64 { return float64(up.NotesRejected()) }
	if shared != nil {
		m.Register(metrics.NewVec("store_available", "1 when the store shared by the fleet is in use, 0 while its breaker is open.",
			false, []string{"store"}, func(emit func(float64, ...string)) {
				emit(boolValue(shared.Available()), shared.Name())
			}))
		m.Register(metrics.NewVec("store_errors_total", "Commands to the store shared by the fleet that failed (timeouts, refused connections, errors from the store).",
			true, []string{"store"}, func(emit func(float64, ...string)) {
				emit(float64(shared.life.Errors()), shared.Name())
			}))
		rejected = func() float64 { return float64(up.NotesRejected() + shared.life.Rejected()) }
		m.Register(metrics.NewVec("fleet_flights_unlocked_total", "Flights this instance led without the fleet's lock (PostgreSQL: past postgres.flight_locks, or with the server's lock table full; always 0 with Redis): another instance may have fetched the same key meanwhile.",
			true, []string{"store"}, func(emit func(float64, ...string)) {
				emit(float64(shared.life.UnlockedFlights()), shared.Name())
			}))
	}
	m.Counter("fleet_notes_rejected_total", "Events, notes and stored values from the shared store that were ignored because they could not be read (another version, a person with redis-cli, a bug).",
		rejected)
}

func boolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
