package rediscache

import (
	"net/http"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fleettest"
)

// contract is the factory the fleettest contracts start their fleets
// with: instances configured as base, with what the contract asks on
// top, on a redis-server of their own (which the contract may kill).
// keep, when not nil, receives the fixture, for a test to go on with
// what only Redis has.
func contract(base Config, keep **fleetFixture) fleettest.Factory {
	return func(t *testing.T, o fleettest.Options, h http.HandlerFunc) *fleettest.Fleet {
		t.Helper()
		rc := base
		o.Set(&rc.LocalTTL, &rc.StatsFlush, &rc.PollInterval, &rc.BreakerInterval, &rc.BreakerFailures)
		f := newFleet(t, o.Instances, rc, o.Dedup, h)
		if keep != nil {
			*keep = f
		}
		cf := f.contractFleet()
		// The bound the Redis test had before it was shared (its
		// recovery took 0.25 to 1.2 s in runs here).
		cf.ResumeWithin = 3 * time.Second
		cf.Kill, cf.Restart = f.redis.Kill, f.redis.Restart
		return cf
	}
}

// contractFleet is the fleet as the fleettest contracts see it, but for
// what only the factory knows (ResumeWithin, Kill, Restart).
func (f *fleetFixture) contractFleet() *fleettest.Fleet {
	cf := &fleettest.Fleet{Store: "redis", StatsDays: statsDays, Origin: f.origin, Hits: f.hits.Load}
	for _, i := range f.insts {
		cf.Insts = append(cf.Insts, &fleettest.Instance{
			Name: i.name, Engine: i.engine, Store: i.store, Local: i.store.local, Bus: i.bus,
			FleetWaits: i.store.fleetWaits.Load, Available: i.be.Available, Stop: i.stop,
		})
	}
	return cf
}
