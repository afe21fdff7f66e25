package app

import (
	"context"
	"log/slog"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/pgstore"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/rediscache"
	"github.com/seed-a3c387e8/onceproxy/proxy/ratelimit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// shared is the store the instances of a fleet share, as the wiring sees
// it: the parts its consumers declare. Each backend is a package of its own
// (rediscache, pgstore); openShared picks one from the configuration, and
// nothing else in the wiring knows which it is.
type shared struct {
	name string
	// cache is the shared cache and flights.
	cache interface {
		dedup.Store
		dedup.Fleet
		// AdvertisePeer names this instance's peer listener in the
		// flights it leads.
		AdvertisePeer(addr string)
	}
	// bus carries session news, claims, sticky bindings, rate-limit
	// counters and the per-day statistics.
	bus interface {
		upstream.Bus
		upstream.Claimer
		upstream.Bindings
		ratelimit.Counter
		dedup.Recorder
		FleetStats(ctx context.Context) (dedup.FleetStats, error)
	}
	// life runs and releases the backend.
	life interface {
		Run(ctx context.Context) error
		Close() error
		Available() bool
		Rejected() int64
		Errors() int64
		// UnlockedFlights counts the flights led without the fleet's
		// lock (PostgreSQL past flight_locks, or its lock table full).
		UnlockedFlights() int64
	}
}

// openShared opens the configured shared store; nil when none is
// configured and this instance runs alone. The configuration allows one
// at most.
func openShared(cfg *Config, local *dedup.MemoryStore, logger *slog.Logger) (*shared, error) {
	switch {
	case cfg.Redis.Enabled():
		rediscache.RouteLogs(logger)
		b, err := rediscache.Open(cfg.Redis, local, logger)
		if err != nil {
			return nil, err
		}
		return &shared{name: "redis", cache: b.Cache, bus: b.Bus, life: b}, nil
	case cfg.Postgres.Enabled():
		b, err := pgstore.Open(cfg.Postgres, local, logger)
		if err != nil {
			return nil, err
		}
		return &shared{name: "postgres", cache: b.Cache, bus: b.Bus, life: b}, nil
	}
	logger.Info("no shared store configured: cache and flights are this process's only")
	return nil, nil
}

// The admin API's view of the shared store (admin.Fleet).

func (s *shared) Name() string    { return s.name }
func (s *shared) Available() bool { return s.life.Available() }
func (s *shared) FleetStats(ctx context.Context) (dedup.FleetStats, error) {
	return s.bus.FleetStats(ctx)
}
