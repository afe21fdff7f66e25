// Package fleettest is the contract test of the fleet stores
// (proxy/dedup/rediscache and proxy/dedup/pgstore): several onceproxy
// instances sharing one store behave as one. Each property is written here
// once; each store's tests run it, from a test of the same name, with a
// Factory that starts the instances on the store's own throw-away server.
// What only one store has (Redis Cluster hash tags and scripts, advisory
// locks, LISTEN/NOTIFY, the schema) stays in that store's tests, which may
// go on from a contract with the fixture their factory kept. Only tests
// import it.
package fleettest

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// Options is what a contract asks of the fleet it starts. A factory sets
// each duration and count on its store's configuration key of the same
// name (Set); a zero field leaves the factory's own value.
type Options struct {
	// Instances is how many instances share the store (at least 1).
	Instances       int
	LocalTTL        time.Duration
	StatsFlush      time.Duration
	PollInterval    time.Duration
	BreakerInterval time.Duration
	BreakerFailures int
	// Killable: the contract stops and restarts the server (Fleet.Kill,
	// Fleet.Restart), so the fleet needs a server of its own.
	Killable bool
	// Dedup is every instance's engine configuration (enabled, with the
	// factory's TTL when zero).
	Dedup dedup.Config
}

// Set puts on a store's configuration keys of the same names what the
// contract asks for, and leaves the keys of zero fields as they are.
func (o Options) Set(localTTL, statsFlush, pollInterval, breakerInterval *time.Duration, breakerFailures *int) {
	for _, d := range []struct {
		to *time.Duration
		v  time.Duration
	}{
		{localTTL, o.LocalTTL}, {statsFlush, o.StatsFlush}, {pollInterval, o.PollInterval}, {breakerInterval, o.BreakerInterval},
	} {
		if d.v != 0 {
			*d.to = d.v
		}
	}
	if o.BreakerFailures != 0 {
		*breakerFailures = o.BreakerFailures
	}
}

// Factory starts a fleet for the test, all its instances in front of one
// origin served by origin, and stops it when the test ends.
type Factory func(t *testing.T, o Options, origin http.HandlerFunc) *Fleet

// Fleet is what a contract sees of the instances a factory started.
type Fleet struct {
	// Store is what the fleet's statistics call the store ("redis"), and
	// StatsDays how many days they report.
	Store     string
	StatsDays int
	Origin    *httptest.Server
	// Hits counts the requests the origin has had.
	Hits  func() int64
	Insts []*Instance
	// ResumeWithin bounds how long after Restart, with OutageDuringLoad's
	// 400 ms breaker interval, sharing must have resumed: each store
	// recovers in steps of its own, and kept the bound it had before the
	// contract was shared.
	ResumeWithin time.Duration
	// Kill stops the store's server and Restart starts it again, with
	// what it held when stopped or without, as the store's server does;
	// nil where the fleet shares a server with other tests, which a
	// contract that kills it avoids with Options.Killable.
	Kill, Restart func()
}

// Instance is one onceproxy process as far as the contract goes.
type Instance struct {
	Name   string
	Engine *dedup.Engine
	// Store is the instance's tiered store (the shared store behind
	// Local), and Local the memory tier in front of the shared store.
	Store dedup.Store
	Local *dedup.MemoryStore
	Bus   Bus
	// FleetWaits counts the instance's flights that wait on a flight of
	// another instance.
	FleetWaits func() int64
	// Available is the store's breaker: false while the store is away.
	Available func() bool
	// Stop closes the instance (its cleanup does too); idempotent.
	Stop func()
}

// Bus is the fleet news an instance's store carries besides the cache.
type Bus interface {
	Publish(topic, key, msg string, ttl time.Duration)
	Subscribe(topic string, f func(msg string, left time.Duration))
	Claim(ctx context.Context, name string, ttl time.Duration) (release func(), ok bool)
	FleetStats(ctx context.Context) (dedup.FleetStats, error)
}

// Got is what a client got through an instance.
type Got struct {
	Status int
	XCache string
	Key    string
	Body   string
	Err    error
}

// Get sends a request through i, and returns once i's flights have
// handed what they fetched to the fleet's store, which they do just after
// their clients have it (dedup's endLease): the test's next step sees the
// store as the request left it.
func (i *Instance) Get(url string) Got { return Get(i.Engine, url) }

// Get is Instance.Get for an engine.
func Get(e *dedup.Engine, url string) Got {
	g := GetNow(e, url)
	if !testkit.Poll(testkit.Patience, func() bool { return e.Stats().Sharing == 0 }) && g.Err == nil {
		g.Err = errors.New("the instance's flights never handed their values to the store")
	}
	return g
}

// GetNow is Get without the wait for the store.
func GetNow(e *dedup.Engine, url string) Got {
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	resp, err := e.RoundTrip(req)
	if err != nil {
		g := Got{Err: err}
		if de, ok := err.(*dedup.Error); ok {
			g.XCache = de.Cache
		}
		return g
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return Got{resp.StatusCode, resp.Header.Get(dedup.HeaderCache), resp.Header.Get(dedup.HeaderCacheKey), string(b), err}
}

// Waiters counts the clients waiting on a flight, on every instance.
func (f *Fleet) Waiters() int64 {
	var n int64
	for _, i := range f.Insts {
		n += i.Engine.Stats().Waiters
	}
	return n
}

// FleetWaiting counts the instances whose flight waits on another
// instance's: a client counted by Waiters may not have got that far yet,
// and one that joins after the leader finished runs a flight of its own.
func (f *Fleet) FleetWaiting() int64 {
	var n int64
	for _, i := range f.Insts {
		n += i.FleetWaits()
	}
	return n
}

// EveryoneWaiting: n clients wait, and every instance but the leader's
// waits on the leader's flight.
func (f *Fleet) EveryoneWaiting(n int64) bool {
	return f.Waiters() == n && f.FleetWaiting() == int64(len(f.Insts)-1)
}

// localDropped reports whether i's memory tier no longer holds key.
func (i *Instance) localDropped(key string) bool {
	_, err := i.Local.Get(context.Background(), key)
	return err != nil
}
