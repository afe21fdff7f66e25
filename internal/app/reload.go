package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/netguard"
	"github.com/seed-a3c387e8/onceproxy/proxy/admin"
	"github.com/seed-a3c387e8/onceproxy/proxy/auth"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// A reload (SIGHUP, or POST /config/reload on the admin port) reads the
// configuration again and applies what can change while the proxy serves,
// without dropping a connection or a flight. The parts it replaces are
// read through the atomic pointers of live by the wrappers Build handed to
// the proxy, so a request sees either the old or the new setting, never a
// mix. A key that cannot change live (a listener, the shared store, the CA
// folder) is reported and its running value kept. A configuration with any
// problem is refused whole, every problem listed, and the running one
// stays.

// live holds what a reload replaces in place.
type live struct {
	guard atomic.Pointer[netguard.Guard]
	users atomic.Pointer[auth.Users]
	level *slog.LevelVar
}

// CheckHostContext is the proxy's early target check, by the current
// guard (proxy.TargetGuard).
func (l *live) CheckHostContext(ctx context.Context, host string) (context.Context, error) {
	return l.guard.Load().CheckHostContext(ctx, host)
}

// Control is the dial-time check, by the current guard.
func (l *live) Control(ctx context.Context, network, address string, c syscall.RawConn) error {
	return l.guard.Load().Control(ctx, network, address, c)
}

// Verify checks proxy credentials against the current users
// (proxy.UserStore, socks.UserStore).
func (l *live) Verify(client, user, password string) (bool, time.Duration) {
	return l.users.Load().Verify(client, user, password)
}

// liveKeys are the configuration keys a reload applies, by prefix; every
// other key needs a restart, and so do the upstream keys that shape the
// connections every session holds (upstream.RestartKeys). The savings
// keys are not live: the dedup engine prices savings through the upstream
// pool (dedup.Options.Prices), which keeps the prices it was built with
// (upstream.WithPrices) for the sessions whose provider sets none and for
// direct requests; and a new currency alone would relabel the money saved
// so far (onceproxy_money_saved_total{currency}), priced in the old one.
var liveKeys = []string{"log.level", "auth.users", "rate_limit.", "guard.", "upstream.",
	"dedup.enabled", "dedup.ttl", "dedup.key_headers", "dedup.ignore_params", "dedup.cacheable_statuses", "dedup.rules"}

func isLive(key string) bool {
	for _, k := range upstream.RestartKeys {
		if key == "upstream."+k {
			return false
		}
	}
	for _, p := range liveKeys {
		if strings.HasPrefix(key, p) {
			return true
		}
	}
	return false
}

// reloader serializes reloads and remembers where the configuration comes
// from.
type reloader struct {
	mu   sync.Mutex
	load func() (*Config, error)
}

// Reload reads the configuration again and applies it. The result lists
// the keys applied and those kept until a restart; an error means nothing
// changed. Every refusal is logged here: a SIGHUP has nobody else to tell.
func (a *App) Reload() (admin.Reload, error) {
	res, err := a.reloadOnce()
	if err != nil {
		a.log.Error("configuration reload refused; the running configuration stays", "err", err)
	}
	return res, err
}

func (a *App) reloadOnce() (admin.Reload, error) {
	a.reload.mu.Lock()
	defer a.reload.mu.Unlock()
	if a.reload.load == nil {
		return admin.Reload{}, errors.New("reload: this instance was built without a configuration source")
	}
	next, err := a.reload.load()
	if err != nil {
		return admin.Reload{}, err
	}
	var res admin.Reload
	for _, k := range changedKeys(a.cfg, next) {
		if isLive(k) {
			res.Changed = append(res.Changed, k)
		} else {
			res.Restart = append(res.Restart, k)
		}
	}
	// What needs a restart keeps its running value.
	merged := *a.cfg
	merged.Log.Level = next.Log.Level
	merged.Auth.Users = next.Auth.Users
	merged.RateLimit = next.RateLimit
	merged.Guard = next.Guard
	merged.Dedup.Enabled, merged.Dedup.TTL = next.Dedup.Enabled, next.Dedup.TTL
	merged.Dedup.KeyHeaders, merged.Dedup.IgnoreParams = next.Dedup.KeyHeaders, next.Dedup.IgnoreParams
	merged.Dedup.CacheableStatuses, merged.Dedup.Rules = next.Dedup.CacheableStatuses, next.Dedup.Rules
	merged.Upstream = next.Upstream
	// Every key that needs a restart keeps its running value, those inside
	// the sections copied whole above too (upstream.dial_timeout, the
	// savings prices): a.cfg must say what runs, or the next reload would
	// no longer report them. (Reconfigure keeps upstream.RestartKeys
	// itself.)
	running := envKeys(a.cfg)
	for name, k := range envKeys(&merged) {
		if !isLive(k.path) {
			k.field.Set(running[name].field)
		}
	}

	// Prepare every new part first: nothing is swapped unless all of them
	// can be built.
	guard, err := netguard.New(merged.Guard)
	if err != nil {
		return admin.Reload{}, fmt.Errorf("reload: guard: %w", err)
	}
	// The users' store is rebuilt only when auth changed: a new one would
	// forget each client's failed logins (auth.max_failures_per_minute)
	// and the credentials it verified.
	var users *auth.Users
	if !reflect.DeepEqual(a.cfg.Auth, merged.Auth) {
		if users, err = auth.New(merged.Auth, a.getenv); err != nil {
			return admin.Reload{}, fmt.Errorf("reload: %w", err)
		}
	}
	if users != nil && users.Enabled() != a.live.users.Load().Enabled() {
		// Turning authentication on or off changes what the doors do
		// with every connection (and which listeners are safe): restart.
		users.Close()
		users = nil
		merged.Auth.Users = a.cfg.Auth.Users
		res.Changed = slices.DeleteFunc(res.Changed, func(k string) bool { return strings.HasPrefix(k, "auth.users") })
		res.Restart = append(res.Restart, "auth.users (turning authentication on or off)")
	}
	if err := merged.Dedup.Validate(); err != nil {
		if users != nil {
			users.Close()
		}
		return admin.Reload{}, fmt.Errorf("reload: dedup: %w", err)
	}
	// The upstream is the one part whose new setup is checked as it is
	// swapped in: a failure there changes nothing, so it goes first, and
	// nothing after it may fail.
	if !reflect.DeepEqual(a.cfg.Upstream, merged.Upstream) {
		if err := a.Upstream.Reconfigure(merged.Upstream); err != nil {
			if users != nil {
				users.Close()
			}
			return admin.Reload{}, fmt.Errorf("reload: %w", err)
		}
	}

	// Commit. The configuration passed LoadConfig's checks, so none of
	// these can fail; were one to, it is logged and the rest applied.
	if err := a.Limiter.Reconfigure(merged.RateLimit); err != nil {
		a.log.Error("configuration reload: rate_limit not applied", "err", err)
	}
	a.polite.Reconfigure(merged.RateLimit)
	if err := a.Engine.Reconfigure(merged.Dedup, merged.Savings); err != nil {
		a.log.Error("configuration reload: dedup not applied", "err", err)
	}
	a.live.guard.Store(guard)
	if !reflect.DeepEqual(a.cfg.Guard, merged.Guard) {
		a.Upstream.RetireDirect()
	}
	if users != nil {
		// Requests being verified by the old store finish with it; its
		// cache only stops refreshing.
		a.live.users.Swap(users).Close()
	}
	if a.live.level != nil {
		var lv slog.Level
		if err := lv.UnmarshalText([]byte(merged.Log.Level)); err == nil {
			a.live.level.Set(lv)
		}
	}
	a.cfg = &merged
	if len(res.Restart) > 0 {
		a.log.Warn("configuration keys that need a restart were changed; their running values stay", "keys", res.Restart)
	}
	a.log.Info("configuration reloaded", "changed", res.Changed)
	return res, nil
}

// changedKeys lists the configuration keys whose values differ, in key
// order.
func changedKeys(old, next *Config) []string {
	a, b := envKeys(old), envKeys(next)
	var out []string
	for name, k := range a {
		if !reflect.DeepEqual(k.field.Interface(), b[name].field.Interface()) {
			out = append(out, k.path)
		}
	}
	slices.Sort(out)
	return out
}

// serveReloads reloads on every signal from hup until ctx ends.
func (a *App) serveReloads(ctx context.Context, hup <-chan os.Signal) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
			a.log.Info("SIGHUP: reloading the configuration")
			_, _ = a.Reload()
		}
	}
}
