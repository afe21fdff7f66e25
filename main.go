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
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/seed-a3c387e8/onceproxy/mitm"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/rediscache"
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

	ca, err := mitm.LoadOrCreate(cfg.MITM, logger)
	if err != nil {
		return err
	}
	defer ca.Close()
	up, err := upstream.New(cfg.Upstream, logger)
	if err != nil {
		return err
	}
	defer up.Close()
	logger.Info("upstream", "egress", up.Describe())

	local := dedup.NewMemoryStore(int64(cfg.Dedup.Memory.MaxBytes))
	defer local.Close()
	dopts := dedup.Options{Store: local, Next: up, Logger: logger}
	var shared *rediscache.Store
	if cfg.Redis.Enabled() {
		rediscache.RouteLogs(logger)
		shared, err = rediscache.New(cfg.Redis, local, logger)
		if err != nil {
			return err
		}
		defer shared.Close()
		dopts.Store, dopts.Fleet, dopts.Recorder = shared, shared, shared
	} else {
		logger.Info("no redis configured: cache and flights are this process's only")
	}
	engine, err := dedup.New(cfg.Dedup, dopts)
	if err != nil {
		return err
	}
	// Flights still running after the proxy drained are cut here.
	defer engine.Close()

	px, err := proxy.New(cfg.Proxy, proxy.Options{
		Logger:    logger,
		Certs:     ca,
		Upstream:  up,
		Next:      engine,
		AccessLog: cfg.Log.Access,
	})
	if err != nil {
		return err
	}

	proxyLn, err := net.Listen("tcp", cfg.Proxy.Listen)
	if err != nil {
		return fmt.Errorf("proxy.listen: %w", err)
	}
	var (
		adminSrv *http.Server
		adminLn  net.Listener
	)
	if cfg.Admin.Listen != "" {
		adminLn, err = net.Listen("tcp", cfg.Admin.Listen)
		if err != nil {
			proxyLn.Close()
			return fmt.Errorf("admin.listen: %w", err)
		}
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
			}),
			ReadHeaderTimeout: 5 * time.Second,
			IdleTimeout:       time.Minute,
			ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
		}
		logger.Info("admin listening", "addr", adminLn.Addr().String(),
			"ca_download", "http://"+adminLn.Addr().String()+"/ca.pem")
	}
	if onReady != nil {
		adminAddr := ""
		if adminLn != nil {
			adminAddr = adminLn.Addr().String()
		}
		onReady(proxyLn.Addr().String(), adminAddr)
	}

	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return px.Serve(proxyLn) })
	if shared != nil {
		g.Go(func() error { return shared.Run(gctx) })
	}
	if adminSrv != nil {
		g.Go(func() error {
			if err := adminSrv.Serve(adminLn); !errors.Is(err, http.ErrServerClosed) {
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
