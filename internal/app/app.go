// Package app is onceproxy as a program: the configuration (config.go), the
// wiring of the parts from it (Build), and their life until shutdown
// (Serve). main and the tests that run the whole proxy use the same Build,
// so the tests exercise the wiring users run.
package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/seed-a3c387e8/onceproxy/internal/listenaddr"
	"github.com/seed-a3c387e8/onceproxy/internal/metrics"
	"github.com/seed-a3c387e8/onceproxy/internal/netguard"
	"github.com/seed-a3c387e8/onceproxy/mitm"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/admin"
	"github.com/seed-a3c387e8/onceproxy/proxy/auth"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/ratelimit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// Options are what Build needs besides the configuration.
type Options struct {
	// Logger receives every log line. Required.
	Logger *slog.Logger
	// Getenv reads the process environment (auth.users[].password_env,
	// upstream.provider.api_key_env, admin.token_env). nil reads nothing.
	Getenv func(string) string
	// Load reads the configuration again, for a reload (SIGHUP, POST
	// /config/reload); nil: the instance cannot reload.
	Load func() (*Config, error)
	// LogLevel, when set, is the logger's level: a reload sets it from
	// log.level.
	LogLevel *slog.LevelVar
	// HUP delivers SIGHUP: each one reloads the configuration.
	HUP <-chan os.Signal
	// LogDropped counts the log lines the log output lost for being
	// slower than the logging (logwriter.Writer.Dropped); nil: none.
	LogDropped func() int64

	// The seams below let a test observe or replace one part of the
	// wiring users run; the program leaves them unset.

	// UpstreamOptions are added to the upstream pool's (a name lookup
	// that counts, say).
	UpstreamOptions []upstream.Option
	// WrapNext wraps the stage the proxy hands every request to (the dedup
	// engine, in front of the upstream).
	WrapNext func(http.RoundTripper) http.RoundTripper
	// WrapUpstream wraps the upstream the proxy opens blind tunnels and
	// protocol switches through.
	WrapUpstream func(proxy.Upstream) proxy.Upstream
}

// App is a built onceproxy: listeners bound, CA loaded, every part wired.
// Serve runs it; Close releases what Build made (Serve calls it).
type App struct {
	cfg    *Config
	log    *slog.Logger
	getenv func(string) string
	hup    <-chan os.Signal
	lns    *listeners
	live   live
	reload reloader
	polite *ratelimit.Polite
	shared *shared      // nil: this instance runs alone
	admin  *http.Server // nil when admin.listen is ""
	peer   *peerServer  // nil when fleet.peer_listen is ""

	// The parts, for the tests that look inside.
	CA       *mitm.Authority
	Upstream *upstream.Pool
	Engine   *dedup.Engine
	Limiter  *ratelimit.Limiter
	Proxy    *proxy.Server
	Metrics  *metrics.Metrics

	closers []func() // in the order they were made; run backwards
}

// Build wires onceproxy from cfg. It binds the listeners first: the SSRF
// guard must know the proxy's own addresses before the upstream can dial
// anything, and a busy port should fail start-up before a CA is created.
// On error, everything built so far is released.
func Build(cfg *Config, o Options) (_ *App, err error) {
	if o.Logger == nil {
		return nil, errors.New("app: Options.Logger is required")
	}
	getenv := o.Getenv
	if getenv == nil {
		getenv = func(string) string { return "" }
	}
	// A Config from LoadConfig is complete already; one put together in
	// code (tests) gets its defaults and the same checks here.
	c := *cfg
	c.withDefaults()
	if err := c.validate(getenv); err != nil {
		return nil, err
	}
	cfg = &c
	a := &App{cfg: cfg, log: o.Logger, getenv: getenv, hup: o.HUP, live: live{level: o.LogLevel}, reload: reloader{load: o.Load}}
	defer func() {
		if err != nil {
			a.Close()
		}
	}()
	logger := a.log

	if a.lns, err = listen(cfg); err != nil {
		return nil, err
	}
	a.closers = append(a.closers, a.lns.close)
	if a.CA, err = mitm.LoadOrCreate(cfg.MITM, logger); err != nil {
		return nil, err
	}
	a.closers = append(a.closers, a.CA.Close)
	guard, err := netguard.New(cfg.Guard)
	if err != nil {
		return nil, err
	}
	a.live.guard.Store(guard)
	local := dedup.NewMemoryStore(int64(cfg.Dedup.Memory.MaxBytes))
	a.closers = append(a.closers, local.Close)
	if a.shared, err = openShared(cfg, local, logger); err != nil {
		return nil, err
	}
	if a.shared != nil {
		a.closers = append(a.closers, func() { _ = a.shared.life.Close() })
	}

	upOpts := append([]upstream.Option{upstream.WithDialControl(a.lns.guardControl(&a.live)), upstream.WithGetenv(getenv),
		upstream.WithPrices(cfg.Savings)}, o.UpstreamOptions...)
	if a.shared != nil {
		// Session cooldowns and rotations are fleet news; sticky keys'
		// sessions are the fleet's.
		upOpts = append(upOpts, upstream.WithBus(a.shared.bus))
	}
	if a.Upstream, err = upstream.New(cfg.Upstream, logger, upOpts...); err != nil {
		return nil, err
	}
	a.closers = append(a.closers, a.Upstream.Close)
	logger.Info("upstream", "egress", a.Upstream.Describe())
	// Politeness pacing sits behind dedup: only requests that really go
	// upstream wait for their turn at a host.
	a.polite = ratelimit.NewPolite(cfg.RateLimit, a.Upstream)
	a.closers = append(a.closers, a.polite.Close)

	// Savings are priced per upstream: a session's provider's prices,
	// else the savings section's.
	dopts := dedup.Options{Store: local, Next: a.polite, Logger: logger, Savings: cfg.Savings, Prices: a.Upstream}
	var counter ratelimit.Counter
	if a.shared != nil {
		dopts.Store, dopts.Fleet, dopts.Recorder = a.shared.cache, a.shared.cache, a.shared.bus
		counter = a.shared.bus
	}
	peerToken := peerToken(cfg.Fleet, getenv)
	if a.lns.peer != nil {
		pc := dedup.NewPeerClient(dedup.PeerClientConfig{Token: peerToken, Timeout: cfg.Fleet.PeerTimeout, IdleTimeout: cfg.Fleet.PeerIdleTimeout})
		a.closers = append(a.closers, pc.Close)
		dopts.Peers = pc
	}
	if a.Engine, err = dedup.New(cfg.Dedup, dopts); err != nil {
		return nil, err
	}
	// Flights still running after the proxy drained are cut here.
	a.closers = append(a.closers, a.Engine.Close)
	if a.lns.peer != nil {
		advertised := peerAdvertised(cfg.Fleet, a.lns.peer)
		a.peer = newPeerServer(cfg.Fleet, a.lns.peer, peerToken, advertised, a.Engine.PeerHandler(), logger)
		// Validation made sure a shared store is configured.
		a.shared.cache.AdvertisePeer(advertised)
		logger.Info("peer listening", "addr", a.lns.peer.Addr().String(), "advertised", advertised, "token", peerToken != "")
	}
	warnTTLOverRotation(logger, cfg, a.Upstream)

	if a.Limiter, err = ratelimit.New(cfg.RateLimit, counter); err != nil {
		return nil, err
	}
	a.closers = append(a.closers, a.Limiter.Close)
	users, err := auth.New(cfg.Auth, getenv)
	if err != nil {
		return nil, err
	}
	a.live.users.Store(users)
	a.closers = append(a.closers, func() { a.live.users.Load().Close() })
	a.Metrics = metrics.New(logger)
	popts := proxy.Options{
		Logger:    logger,
		Certs:     a.CA,
		Upstream:  a.Upstream,
		Next:      a.Engine,
		AccessLog: cfg.Log.Access,
		Realm:     cfg.Auth.Realm,
		Limiter:   a.Limiter,
		Guard:     &a.live,
		Metrics:   a.Metrics,
		Origins:   a.Upstream,
	}
	if o.WrapNext != nil {
		popts.Next = o.WrapNext(popts.Next)
	}
	if o.WrapUpstream != nil {
		popts.Upstream = o.WrapUpstream(popts.Upstream)
	}
	if users.Enabled() {
		popts.Users = &a.live
	} else {
		logger.Warn("no proxy users configured: the proxy ports accept anyone who can reach them",
			"proxy", cfg.Proxy.Listen, "socks5", cfg.SOCKS5.Listen)
	}
	if a.Proxy, err = proxy.New(cfg.Proxy, popts); err != nil {
		return nil, err
	}
	registerMetrics(a.Metrics, a.Proxy, a.Engine, a.CA, a.Upstream, a.shared)
	if o.LogDropped != nil {
		a.Metrics.Counter("log_lines_dropped_total", "Log lines dropped because the log output (stderr) was slower than the logging; requests never wait for it.",
			func() float64 { return float64(o.LogDropped()) })
	}

	// The process's logger limits its warnings (NewLogger); one a test
	// builds need not.
	if lim, ok := logger.Handler().(interface{ Suppressed() int64 }); ok {
		a.Metrics.Counter("log_lines_suppressed_total", "Warning and error lines left out because their message had already been written 20 times in the last 10s (a flood of refused or failing requests); the count is logged after the window, with the message's next line or a summary line, or when the process stops.",
			func() float64 { return float64(lim.Suppressed()) })
	}

	if a.lns.admin != nil {
		ao := admin.Options{
			CAPEM:        a.CA.CertPEM(),
			Proxy:        a.Proxy,
			Cache:        a.Engine,
			Sessions:     a.Upstream,
			Fingerprints: a.Proxy,
			Metrics:      a.Metrics.Handler(),
			Token:        adminToken(cfg.Admin, getenv),
			Reloader:     a,
			Pprof:        cfg.Admin.Pprof,
			ProxyAddr:    a.lns.proxy.Addr().String(),
			LocalOnly:    listenaddr.Loopback(cfg.Admin.Listen),
		}
		if a.shared != nil {
			ao.Fleet = a.shared
		}
		a.admin = &http.Server{
			Handler:           admin.New(ao),
			ReadHeaderTimeout: 5 * time.Second,
			// A request's body (a few bytes of JSON) must not hold a
			// connection for ever, nor must a client that stops reading
			// an answer. The write bound is also the longest profile
			// net/http/pprof takes (it refuses ?seconds= past it).
			ReadTimeout:  10 * time.Second,
			WriteTimeout: 2 * time.Minute,
			IdleTimeout:  time.Minute,
			ErrorLog:     slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
		}
		logger.Info("admin listening", "addr", a.lns.admin.Addr().String(),
			"ca_download", "http://"+a.lns.admin.Addr().String()+"/ca.pem")
	}
	return a, nil
}

// Addrs are the bound listener addresses ("" for a listener that is off).
type Addrs struct {
	Proxy, SOCKS5, Admin, Peer string
}

// Addrs returns where the app listens.
func (a *App) Addrs() Addrs {
	var out Addrs
	out.Proxy = a.lns.proxy.Addr().String()
	if a.lns.socks != nil {
		out.SOCKS5 = a.lns.socks.Addr().String()
	}
	if a.lns.admin != nil {
		out.Admin = a.lns.admin.Addr().String()
	}
	if a.lns.peer != nil {
		out.Peer = a.lns.peer.Addr().String()
	}
	return out
}

// Serve runs the app until ctx ends, then shuts down gracefully: in-flight
// requests get proxy.shutdown_grace, then every part is released.
func (a *App) Serve(ctx context.Context) error {
	defer a.Close()
	cfg := a.cfg
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return a.Proxy.Serve(a.lns.proxy) })
	if a.lns.socks != nil {
		g.Go(func() error { return a.Proxy.ServeSOCKS5(a.lns.socks, cfg.SOCKS5) })
	}
	g.Go(func() error { return a.Upstream.Run(gctx) })
	if a.hup != nil {
		g.Go(func() error { a.serveReloads(gctx, a.hup); return nil })
	}
	if a.shared != nil {
		g.Go(func() error { return a.shared.life.Run(gctx) })
	}
	if a.admin != nil {
		g.Go(func() error {
			if err := a.admin.Serve(a.lns.admin); !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("admin: %w", err)
			}
			return nil
		})
	}
	if a.peer != nil {
		g.Go(a.peer.serve)
	}
	g.Go(func() error {
		<-gctx.Done()
		a.log.Info("shutting down", "grace", cfg.Proxy.ShutdownGrace)
		sctx, cancel := context.WithTimeout(context.Background(), cfg.Proxy.ShutdownGrace)
		defer cancel()
		err := a.Proxy.Shutdown(sctx)
		// Cutting what the grace did not see through is how the stop
		// ctx asked for ends, not a failure of the process: a warning
		// says it, and Serve returns nil so that main exits 0. A non-zero
		// status on every rollout that catches a slow request marks a
		// systemd unit failed and fires restart policies and alerts.
		var cut *proxy.GraceError
		if errors.As(err, &cut) {
			a.log.Warn("shutdown: proxy.shutdown_grace ran out; requests still in flight were cut",
				"grace", cfg.Proxy.ShutdownGrace, "requests", cut.Requests, "waiting_for", cut.WaitingFor)
			err = nil
		}
		if a.admin != nil {
			_ = a.admin.Shutdown(sctx)
		}
		if a.peer != nil {
			// Bodies other instances still read from here end with the
			// grace; they finish theirs from the origin.
			if a.peer.srv.Shutdown(sctx) != nil {
				a.peer.ln.CloseAll()
			}
		}
		return err
	})
	err := g.Wait()
	// What the log limit left out of the last window is said now: no
	// later line of the process will.
	if lim, ok := a.log.Handler().(interface{ Flush(context.Context) }); ok {
		lim.Flush(context.Background())
	}
	a.log.Info("stopped")
	return err
}

// Close releases everything Build made, newest first. It is idempotent.
func (a *App) Close() {
	for i := len(a.closers) - 1; i >= 0; i-- {
		a.closers[i]()
	}
	a.closers = nil
}

// adminToken reads the admin bearer token from the variable named by
// admin.token_env ("" = no token). Surrounding white space is dropped: a
// secret mounted from a file usually ends in a newline no client sends.
func adminToken(c AdminConfig, getenv func(string) string) string {
	if c.TokenEnv == "" {
		return ""
	}
	return strings.TrimSpace(getenv(c.TokenEnv))
}
