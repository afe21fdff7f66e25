// Command onceproxy is a request-deduplicating MITM forward proxy for
// scraping fleets: one logical request goes upstream once.
//
// Usage:
//
//	onceproxy [-config config.yaml] [-check]
//
// See README.md for the configuration, trusting the CA, and the admin API.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/seed-a3c387e8/onceproxy/internal/metrics"
	"github.com/seed-a3c387e8/onceproxy/internal/netguard"
	"github.com/seed-a3c387e8/onceproxy/mitm"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/auth"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/rediscache"
	"github.com/seed-a3c387e8/onceproxy/proxy/ratelimit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Environ(), os.Stderr, nil); err != nil {
		fmt.Fprintln(os.Stderr, "onceproxy:", err)
		os.Exit(1)
	}
}

// ready receives the bound addresses once the listeners are up (tests use it).
type ready func(proxyAddr, adminAddr string)

// run is the whole program: parse flags, load the configuration, wire the
// packages, serve until ctx ends, then shut down gracefully.
func run(ctx context.Context, args, environ []string, stderr io.Writer, onReady ready) error {
	fs := flag.NewFlagSet("onceproxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	configPath := fs.String("config", "config.yaml", "configuration file (YAML); a missing default file means built-in defaults")
	check := fs.Bool("check", false, "validate the configuration and exit")
	if err := fs.Parse(args); err != nil {
		return err
	}
	path := *configPath
	explicit := false
	fs.Visit(func(f *flag.Flag) { explicit = explicit || f.Name == "config" })
	if _, err := os.Stat(path); err != nil && !explicit && errors.Is(err, os.ErrNotExist) {
		path = "" // no config.yaml next to us: the built-in defaults are the same text
	}
	cfg, err := loadConfig(path, environ)
	if err != nil {
		return err
	}
	if *check {
		fmt.Fprintln(stderr, "configuration OK")
		return nil
	}
	logger := newLogger(cfg.Log, stderr)
	if path == "" {
		logger.Info("no config file; using built-in defaults")
	} else {
		logger.Info("configuration loaded", "file", path)
	}

	// Listen first: the SSRF guard must know our own addresses before the
	// upstream can dial anything, and a busy port should fail start-up
	// before a CA is created.
	lns, err := listen(cfg)
	if err != nil {
		return err
	}
	defer lns.close()

	ca, err := mitm.LoadOrCreate(cfg.MITM, logger)
	if err != nil {
		return err
	}
	defer ca.Close()

	guard, err := netguard.New(cfg.Guard)
	if err != nil {
		return err
	}
	local := dedup.NewMemoryStore(int64(cfg.Dedup.Memory.MaxBytes))
	defer local.Close()
	var shared *rediscache.Store
	if cfg.Redis.Enabled() {
		rediscache.RouteLogs(logger)
		shared, err = rediscache.New(cfg.Redis, local, logger)
		if err != nil {
			return err
		}
		defer shared.Close()
	} else {
		logger.Info("no redis configured: cache and flights are this process's only")
	}

	upOpts := []upstream.Option{upstream.WithDialControl(lns.guardControl(guard)), upstream.WithGetenv(func(k string) string { return lookupEnv(environ, k) })}
	if shared != nil {
		// Session cooldowns and rotations are fleet news.
		upOpts = append(upOpts, upstream.WithFleet(sessionNews{shared}))
	}
	up, err := upstream.New(cfg.Upstream, logger, upOpts...)
	if err != nil {
		return err
	}
	defer up.Close()
	logger.Info("upstream", "egress", up.Describe())
	if shared != nil {
		shared.Subscribe(sessionTopic, func(msg string) { applySessionNews(logger, up, msg) })
		// Bounded by redis.timeout, like every Redis command.
		recall := func() { recallSessionNews(ctx, logger, shared, up) }
		recall()
		shared.OnReconnect(recall)
	}
	// Politeness pacing sits behind dedup: only requests that really go
	// upstream wait for their turn at a host.
	polite := ratelimit.NewPolite(cfg.RateLimit, up)
	if p, ok := polite.(*ratelimit.Polite); ok {
		defer p.Close()
	}
	dopts := dedup.Options{Store: local, Next: polite, Logger: logger}
	var counter ratelimit.Counter
	if shared != nil {
		dopts.Store, dopts.Fleet, dopts.Recorder = shared, shared, shared
		counter = shared
	}
	engine, err := dedup.New(cfg.Dedup, dopts)
	if err != nil {
		return err
	}
	// Flights still running after the proxy drained are cut here.
	defer engine.Close()
	warnTTLOverRotation(logger, cfg, up)

	limiter, err := ratelimit.New(cfg.RateLimit, counter)
	if err != nil {
		return err
	}
	defer limiter.Close()
	getenv := func(k string) string { return lookupEnv(environ, k) }
	users, err := auth.New(cfg.Auth, getenv)
	if err != nil {
		return err
	}
	defer users.Close()
	popts := proxy.Options{
		Logger:    logger,
		Certs:     ca,
		Upstream:  up,
		Next:      engine,
		AccessLog: cfg.Log.Access,
		Realm:     cfg.Auth.Realm,
		Limiter:   limiter,
		Guard:     guard,
		Metrics:   metrics.New(),
	}
	if users.Enabled() {
		popts.Users = users
	} else {
		logger.Warn("no proxy users configured: the proxy ports accept anyone who can reach them",
			"proxy", cfg.Proxy.Listen, "socks5", cfg.SOCKS5.Listen)
	}
	px, err := proxy.New(cfg.Proxy, popts)
	if err != nil {
		return err
	}
	registerMetrics(popts.Metrics, engine, ca, up, shared)

	var adminSrv *http.Server
	if lns.admin != nil {
		adminSrv = &http.Server{
			Handler: proxy.NewAdmin(proxy.AdminOptions{
				CAPEM: ca.CertPEM(),
				Health: func() map[string]any {
					h := map[string]any{"inflight": px.Inflight()}
					if shared != nil {
						h["redis_available"] = shared.Available()
					}
					return h
				},
				Cache:      engine,
				FleetStats: fleetStats(shared),
				Metrics:    popts.Metrics.Handler(),
				Token:      adminToken(cfg.Admin, getenv),
				Extra:      upstreamRoutes(up),
				Sessions:   sessionViews(up),
				ProxyAddr:  lns.proxy.Addr().String(),
			}),
			ReadHeaderTimeout: 5 * time.Second,
			IdleTimeout:       time.Minute,
			ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
		}
		logger.Info("admin listening", "addr", lns.admin.Addr().String(),
			"ca_download", "http://"+lns.admin.Addr().String()+"/ca.pem")
	}
	if onReady != nil {
		adminAddr := ""
		if lns.admin != nil {
			adminAddr = lns.admin.Addr().String()
		}
		onReady(lns.proxy.Addr().String(), adminAddr)
	}

	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return px.Serve(lns.proxy) })
	if lns.socks != nil {
		g.Go(func() error { return px.ServeSOCKS5(lns.socks, cfg.SOCKS5) })
	}
	g.Go(func() error { return up.Run(gctx) })
	if shared != nil {
		g.Go(func() error { return shared.Run(gctx) })
	}
	if adminSrv != nil {
		g.Go(func() error {
			if err := adminSrv.Serve(lns.admin); !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("admin: %w", err)
			}
			return nil
		})
	}
	g.Go(func() error {
		<-gctx.Done()
		logger.Info("shutting down", "grace", cfg.Proxy.ShutdownGrace)
		sctx, cancel := context.WithTimeout(context.Background(), cfg.Proxy.ShutdownGrace)
		defer cancel()
		err := px.Shutdown(sctx)
		if adminSrv != nil {
			_ = adminSrv.Shutdown(sctx)
		}
		return err
	})
	err = g.Wait()
	logger.Info("stopped")
	return err
}

// fleetStats adapts the shared store's statistics for the admin API; nil
// without Redis.
func fleetStats(s *rediscache.Store) func(context.Context) (any, error) {
	if s == nil {
		return nil
	}
	return func(ctx context.Context) (any, error) { return s.FleetStats(ctx) }
}
