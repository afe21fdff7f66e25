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
	_ "embed"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/app"
	"github.com/seed-a3c387e8/onceproxy/internal/logwriter"
)

// shippedConfig is config.yaml as shipped: the defaults every run starts
// from, so the file users read and the defaults the binary uses are the
// same text.
//
//go:embed config.yaml
var shippedConfig []byte

func main() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The first SIGINT or SIGTERM starts the graceful shutdown; the next
	// ends the process at once, as an operator who sends it means. One
	// channel takes both, so a second signal is never lost however soon it
	// follows the first. (NotifyContext, with the default action restored
	// by an AfterFunc, left a window in which it was swallowed:
	// TestSecondSignalEndsAtOnce failed 2 times in 15 under -race.) The
	// goroutine lives as long as the process.
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-sigs
		cancel()
		sig := <-sigs
		fmt.Fprintf(os.Stderr, "onceproxy: second signal (%v): exiting without waiting for requests in flight\n", sig)
		os.Exit(signalExitCode(sig))
	}()
	if err := run(ctx, os.Args[1:], os.Environ(), os.Stderr, nil); err != nil {
		fmt.Fprintln(os.Stderr, "onceproxy:", err)
		os.Exit(1)
	}
}

// signalExitCode is the status of a process ended by sig, as shells
// report one killed by it: 128 plus its number.
func signalExitCode(sig os.Signal) int {
	if s, ok := sig.(syscall.Signal); ok {
		return 128 + int(s)
	}
	return 1
}

// ready receives the bound addresses once the listeners are up (tests use it).
type ready func(proxyAddr, adminAddr string)

// run is the whole program: parse flags, load the configuration, build the
// parts, serve until ctx ends, then shut down gracefully.
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
	cfg, err := app.LoadConfig(shippedConfig, path, environ)
	if err != nil {
		return err
	}
	if *check {
		fmt.Fprintln(stderr, "configuration OK")
		return nil
	}
	// Lines leave in batches, 50ms late at most: a write per access-log
	// line is a measurable share of a request's CPU.
	logOut := logwriter.New(stderr, 64<<10, 50*time.Millisecond)
	defer logOut.Close()
	logger, level := app.NewLogger(cfg.Log, logOut)
	if path == "" {
		logger.Info("no config file; using built-in defaults")
	} else {
		logger.Info("configuration loaded", "file", path)
	}
	getenv := func(k string) string { return app.LookupEnv(environ, k) }
	app.ApplyRuntime(cfg, getenv, logger)
	// SIGHUP reloads the configuration from the same file and environment.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	a, err := app.Build(cfg, app.Options{
		Logger:     logger,
		Getenv:     getenv,
		LogLevel:   level,
		HUP:        hup,
		LogDropped: logOut.Dropped,
		Load:       func() (*app.Config, error) { return app.LoadConfig(shippedConfig, path, environ) },
	})
	if err != nil {
		return err
	}
	if onReady != nil {
		addrs := a.Addrs()
		onReady(addrs.Proxy, addrs.Admin)
	}
	return a.Serve(ctx)
}
