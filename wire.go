package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"syscall"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/metrics"
	"github.com/seed-a3c387e8/onceproxy/internal/netguard"
	"github.com/seed-a3c387e8/onceproxy/mitm"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/rediscache"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// listeners are the sockets onceproxy serves on.
type listeners struct {
	proxy, socks, admin net.Listener
	// self are the endpoints of our own listeners: the proxy must never
	// connect to itself (a request looping back, or reaching the admin API
	// through the proxy port).
	self []netip.AddrPort
	// selfPorts are the ports of listeners bound to every address.
	selfPorts map[uint16]bool
}

func listen(cfg *Config) (*listeners, error) {
	l := &listeners{selfPorts: map[uint16]bool{}}
	var err error
	if l.proxy, err = net.Listen("tcp", cfg.Proxy.Listen); err != nil {
		return nil, fmt.Errorf("proxy.listen: %w", err)
	}
	if cfg.SOCKS5.Listen != "" {
		if l.socks, err = net.Listen("tcp", cfg.SOCKS5.Listen); err != nil {
			l.close()
			return nil, fmt.Errorf("socks5.listen: %w", err)
		}
	}
	if cfg.Admin.Listen != "" {
		if l.admin, err = net.Listen("tcp", cfg.Admin.Listen); err != nil {
			l.close()
			return nil, fmt.Errorf("admin.listen: %w", err)
		}
	}
	for _, ln := range []net.Listener{l.proxy, l.socks, l.admin} {
		if ln == nil {
			continue
		}
		ap := ln.Addr().(*net.TCPAddr).AddrPort()
		if ap.Addr().IsUnspecified() {
			l.selfPorts[ap.Port()] = true
		} else {
			l.self = append(l.self, netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()))
		}
	}
	return l, nil
}

func (l *listeners) close() {
	for _, ln := range []net.Listener{l.proxy, l.socks, l.admin} {
		if ln != nil {
			ln.Close()
		}
	}
}

// selfError refuses a connection to one of our own listeners.
type selfError struct{ addr netip.AddrPort }

func (e *selfError) Error() string {
	return "refusing to connect to " + e.addr.String() + ": that is onceproxy's own proxy, SOCKS5 or admin port"
}
func (e *selfError) HTTPStatus() int { return http.StatusForbidden }

// isSelf reports whether addr is one of our listeners: an exact listening
// address, or a local address on the port of a listener bound to all
// interfaces.
func (l *listeners) isSelf(ap netip.AddrPort) bool {
	ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	for _, s := range l.self {
		if s == ap || (s.Port() == ap.Port() && s.Addr().IsLoopback() && ap.Addr().IsLoopback()) {
			return true
		}
	}
	if !l.selfPorts[ap.Port()] {
		return false
	}
	if ap.Addr().IsLoopback() || ap.Addr().IsUnspecified() {
		return true
	}
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if p, err := netip.ParsePrefix(a.String()); err == nil && p.Addr().Unmap() == ap.Addr() {
			return true
		}
	}
	return false
}

// guardControl is the dial-time check of every direct origin connection:
// never our own ports, then the SSRF guard on the resolved address.
func (l *listeners) guardControl(g *netguard.Guard) func(ctx context.Context, network, address string, c syscall.RawConn) error {
	return func(ctx context.Context, network, address string, c syscall.RawConn) error {
		if ap, err := netip.ParseAddrPort(address); err == nil && l.isSelf(ap) {
			return &selfError{ap}
		}
		return g.Control(ctx, network, address, c)
	}
}

// adminToken reads the admin bearer token from the variable named by
// admin.token_env ("" = no token).
func adminToken(a AdminConfig, getenv func(string) string) string {
	if a.TokenEnv == "" {
		return ""
	}
	return getenv(a.TokenEnv)
}

// warnTTLOverRotation: a response cached longer than a timed session keeps
// its exit IP may be served after that IP is gone (geo- or IP-specific
// pages), which is worth knowing.
func warnTTLOverRotation(logger *slog.Logger, cfg *Config, up *upstream.Pool) {
	rot, ok := up.TimedRotationMin()
	if !ok {
		return
	}
	check := func(rule string, ttl time.Duration) {
		if ttl > rot {
			logger.Warn("a cache TTL is longer than the shortest timed session rotation: cached answers may outlive the exit IP that fetched them",
				"rule", rule, "ttl", ttl, "rotation", rot)
		}
	}
	if cfg.Dedup.Enabled {
		check("dedup (default)", cfg.Dedup.TTL)
	}
	for i, r := range cfg.Dedup.Rules {
		if r.TTL != nil {
			name := r.Name
			if name == "" {
				name = "dedup.rules[" + strconv.Itoa(i) + "]"
			}
			check(name, *r.TTL)
		}
	}
}

// upstreamRoutes adds the session API to the admin mux.
func upstreamRoutes(up *upstream.Pool) func(*http.ServeMux) {
	return func(mux *http.ServeMux) {
		mux.HandleFunc("GET /upstream/sessions", func(w http.ResponseWriter, r *http.Request) {
			proxy.WriteJSON(w, http.StatusOK, map[string]any{
				"egress":   up.Describe(),
				"sessions": up.Sessions(),
				"provider": up.ProviderStatus(),
			})
		})
		mux.HandleFunc("POST /upstream/sessions/{id}/rotate", func(w http.ResponseWriter, r *http.Request) {
			id := r.PathValue("id")
			if err := up.Rotate(r.Context(), id); err != nil {
				status := http.StatusBadGateway
				var hs interface{ HTTPStatus() int }
				if errors.As(err, &hs) {
					status = hs.HTTPStatus()
				}
				proxy.WriteJSON(w, status, map[string]string{"error": err.Error()})
				return
			}
			proxy.WriteJSON(w, http.StatusOK, map[string]any{"rotated": id})
		})
	}
}

// registerMetrics exposes the totals the components keep themselves.
func registerMetrics(m *metrics.Metrics, engine *dedup.Engine, ca *mitm.Authority, up *upstream.Pool, shared *rediscache.Store) {
	stat := func(f func(dedup.Stats) float64) func() float64 {
		return func() float64 { return f(engine.Stats()) }
	}
	m.Gauge("flights_in_progress", "Upstream fetches others may be waiting on, running now.",
		stat(func(s dedup.Stats) float64 { return float64(s.Flights) }))
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
	m.Counter("certificates_minted_total", "Leaf certificates signed by the local CA.",
		func() float64 { return float64(ca.Stats().Mints) })
	m.Gauge("certificates_cached", "Leaf certificates held in memory.",
		func() float64 { return float64(ca.Stats().Cached) })
	for _, v := range []struct {
		name, help string
		counter    bool
		value      func(upstream.SessionStatus) float64
	}{
		{"upstream_session_requests_total", "Requests sent through each upstream session.", true,
			func(s upstream.SessionStatus) float64 { return float64(s.Requests) }},
		{"upstream_session_failures_total", "Failed requests (429, ban, 5xx, connection error) per upstream session.", true,
			func(s upstream.SessionStatus) float64 { return float64(s.Failures) }},
		{"upstream_session_weight", "Current health weight (1-10) of each upstream session.", false,
			func(s upstream.SessionStatus) float64 { return float64(s.Weight) }},
		{"upstream_session_available", "1 when the session is usable, 0 while it cools down.", false,
			func(s upstream.SessionStatus) float64 { return boolValue(s.Available) }},
	} {
		m.Register(metrics.NewVec(v.name, v.help, v.counter, []string{"session"}, func(emit func(float64, ...string)) {
			for _, s := range up.Sessions() {
				emit(v.value(s), s.ID)
			}
		}))
	}
	if shared != nil {
		m.Gauge("redis_available", "1 when the shared Redis layer is in use, 0 while its breaker is open.",
			func() float64 { return boolValue(shared.Available()) })
	}
}

// sessionViews adapts the pool's sessions for the status page.
func sessionViews(up *upstream.Pool) func() ([]proxy.SessionView, string) {
	return func() ([]proxy.SessionView, string) {
		var out []proxy.SessionView
		for _, s := range up.Sessions() {
			out = append(out, proxy.SessionView{
				ID: s.ID, Proxy: s.Proxy, Rotation: s.Rotation, ExitIP: s.ExitIP, LastOutcome: s.LastOutcome,
				Cooldown: s.CooldownRemaining, Weight: s.Weight, BaseWeight: s.BaseWeight, Available: s.Available,
				Requests: s.Requests, Failures: s.Failures, Rotations: s.Rotations,
			})
		}
		return out, up.Describe()
	}
}

func boolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// sessionTopic is the fleet note topic of upstream session news.
const sessionTopic = "session"

// sessionNews carries upstream session news over the Redis events channel.
type sessionNews struct{ st *rediscache.Store }

var _ upstream.RotationLocker = sessionNews{}

func (n sessionNews) PublishSession(ev upstream.SessionEvent) {
	b, err := json.Marshal(ev)
	if err != nil {
		return
	}
	if ev.Kind == upstream.EventCooldown {
		// Kept while it holds: instances that start later recall it.
		n.st.PublishLasting(sessionTopic, ev.Session, string(b), ev.For)
		return
	}
	n.st.Publish(sessionTopic, string(b))
}

// recallSessionNews applies the cooldowns the fleet knows of that still
// hold: at start, and when Redis comes back after an outage.
func recallSessionNews(ctx context.Context, logger *slog.Logger, st *rediscache.Store, up *upstream.Pool) {
	notes, err := st.Recall(ctx, sessionTopic)
	if err != nil {
		logger.Debug("could not recall the fleet's session cooldowns", "err", err)
		return
	}
	for _, n := range notes {
		if ev, ok := decodeSessionNews(logger, n.Msg); ok {
			ev.For = n.Left // what is left of it now
			up.ApplySessionEvent(ev)
		}
	}
}

// LockRotation makes one instance of the fleet rotate a session at a time.
func (n sessionNews) LockRotation(ctx context.Context, session string, ttl time.Duration) (func(), bool) {
	return n.st.Claim(ctx, "rotate:"+session, ttl)
}

// applySessionNews hands news from another instance to the pool.
func applySessionNews(logger *slog.Logger, up *upstream.Pool, msg string) {
	if ev, ok := decodeSessionNews(logger, msg); ok {
		up.ApplySessionEvent(ev)
	}
}

func decodeSessionNews(logger *slog.Logger, msg string) (upstream.SessionEvent, bool) {
	var ev upstream.SessionEvent
	if err := json.Unmarshal([]byte(msg), &ev); err != nil {
		logger.Debug("ignored a malformed session note from the fleet", "err", err)
		return ev, false
	}
	return ev, true
}
