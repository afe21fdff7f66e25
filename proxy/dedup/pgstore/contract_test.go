package pgstore

import (
	"net/http"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fleettest"
	"github.com/seed-a3c387e8/onceproxy/internal/pgtest"
)

// contract is the factory the fleettest contracts start their fleets
// with: instances configured as base, with what the contract asks on
// top, on a schema of their own on the shared server, or on a private
// server when the contract stops it. keep, when not nil, receives the
// fixture, for a test to go on with what only PostgreSQL has.
func contract(base Config, keep **fleetFixture) fleettest.Factory {
	return func(t *testing.T, o fleettest.Options, h http.HandlerFunc) *fleettest.Fleet {
		t.Helper()
		pc := base
		o.Set(&pc.LocalTTL, &pc.StatsFlush, &pc.PollInterval, &pc.BreakerInterval, &pc.BreakerFailures)
		var f *fleetFixture
		var kill, restart func()
		if o.Killable {
			pg := pgtest.Start(t)
			f = newFleetOn(t, pg, o.Instances, pc, o.Dedup, h)
			kill, restart = pg.Stop, pg.Start
		} else {
			f = newFleet(t, o.Instances, pc, o.Dedup, h)
		}
		if keep != nil {
			*keep = f
		}
		cf := f.contractFleet()
		// The breaker interval, and slack for a loaded machine.
		cf.ResumeWithin = pc.BreakerInterval + 2*time.Second
		cf.Kill, cf.Restart = kill, restart
		return cf
	}
}

// contractFleet is the fleet as the fleettest contracts see it, but for
// what only the factory knows (ResumeWithin, Kill, Restart).
func (f *fleetFixture) contractFleet() *fleettest.Fleet {
	cf := &fleettest.Fleet{Store: "postgres", StatsDays: statsDays, Origin: f.origin, Hits: f.hits.Load}
	for _, i := range f.insts {
		cf.Insts = append(cf.Insts, &fleettest.Instance{
			Name: i.name, Engine: i.engine, Store: i.store, Local: i.local, Bus: i.bus,
			FleetWaits: i.store.fleetWaits.Load, Available: i.be.Available, Stop: i.stop,
		})
	}
	return cf
}
