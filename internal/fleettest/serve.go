package fleettest

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// EngineConfig is dc as a test instance runs it: enabled, with a minute's
// TTL unless dc says otherwise, and the defaults of the rest.
func EngineConfig(dc dedup.Config) dedup.Config {
	dc.Enabled = true
	if dc.TTL == 0 {
		dc.TTL = time.Minute
	}
	return dc.WithDefaults()
}

// Serve runs an instance the way the program does, over the store a
// factory opened: an engine made of dc and opts (its savings priced at
// Prices), reading bodies too big for the store from other instances'
// peer listeners and serving its own when advertise (the store's
// AdvertisePeer) is not nil, and the store's background work, run, until
// the instance stops. stop, which the test's end calls too and which runs
// once, closes the engine, ends run, closes the store, then calls closers
// in order (its memory tier, the transport). peer is nil without
// advertise.
func Serve(t testing.TB, dc dedup.Config, opts dedup.Options, advertise func(addr string), run func(context.Context) error, closeStore func() error, closers ...func()) (eng *dedup.Engine, peer *PeerListener, stop func()) {
	t.Helper()
	opts.Savings = Prices
	if advertise != nil {
		peer = StartPeerListener(t, advertise)
		opts.Peers = peer.Client
	}
	eng, err := dedup.New(dc, opts)
	if err != nil {
		closeStore()
		for _, c := range closers {
			c()
		}
		t.Fatal(err)
	}
	if peer != nil {
		peer.Engine.Store(eng)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	// What run returns once its context is over says only that it is.
	go func() { defer close(done); _ = run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			eng.Close()
			cancel()
			<-done
			// What Close returns is not what a contract checks (goleak
			// checks that nothing outlives it).
			closeStore()
			for _, c := range closers {
				c()
			}
		})
	}
	t.Cleanup(stop)
	return eng, peer, stop
}
