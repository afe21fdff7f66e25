package ratelimit

import (
	"fmt"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/maypok86/otter/v2"
	"golang.org/x/time/rate"

	"github.com/seed-a3c387e8/onceproxy/internal/hostmatch"
)

// Polite paces requests to each target host: a token bucket per host
// (PerHostRPS, PerHostBurst) shared by every client of this process. A
// request waits for its turn, bounded by its context (the flight deadline);
// it is never refused outright. It sits in front of the upstream, behind
// dedup, so only requests that really go upstream are paced.
type Polite struct {
	next http.RoundTripper
	pace atomic.Pointer[pace] // nil: requests pass straight through
}

// pace is one configuration's buckets.
type pace struct {
	rps   rate.Limit
	burst int
	hosts *otter.Cache[string, *rate.Limiter]
}

// NewPolite wraps next; with cfg.PerHostRPS == 0 requests pass straight
// through (and no per-host table is kept).
func NewPolite(cfg Config, next http.RoundTripper) *Polite {
	p := &Polite{next: next}
	p.Reconfigure(cfg)
	return p
}

// Reconfigure sets the pace from cfg while requests flow (a reload of the
// configuration). A new pace starts every host with a full bucket; a
// reload that leaves the pace as it was keeps the buckets, so that it does
// not let a burst through to every host.
func (p *Polite) Reconfigure(cfg Config) {
	cfg = cfg.WithDefaults()
	if cur := p.pace.Load(); cur != nil && cur.rps == rate.Limit(cfg.PerHostRPS) && cur.burst == cfg.PerHostBurst {
		return
	}
	var next *pace
	if cfg.PerHostRPS > 0 {
		next = &pace{
			rps:   rate.Limit(cfg.PerHostRPS),
			burst: cfg.PerHostBurst,
			hosts: otter.Must(&otter.Options[string, *rate.Limiter]{
				MaximumSize:      50_000,
				ExpiryCalculator: otter.ExpiryAccessing[string, *rate.Limiter](10 * time.Minute),
			}),
		}
	}
	if old := p.pace.Swap(next); old != nil {
		old.hosts.StopAllGoroutines()
	}
}

// RoundTrip implements http.RoundTripper.
func (p *Polite) RoundTrip(req *http.Request) (*http.Response, error) {
	pc := p.pace.Load()
	if pc == nil {
		return p.next.RoundTrip(req)
	}
	// One bucket per name, however it is spelled (hostmatch.Normalize, the form host patterns match
	// in): "site.test." with a bucket of its own would double the pace at that site.
	host := hostmatch.Normalize(req.URL.Hostname())
	lim, _ := pc.hosts.ComputeIfAbsent(host, func() (*rate.Limiter, bool) { return rate.NewLimiter(pc.rps, pc.burst), false })
	if err := lim.Wait(req.Context()); err != nil {
		return nil, fmt.Errorf("ratelimit: waiting for a turn at %s (per_host_rps %v): %w", host, float64(pc.rps), err)
	}
	return p.next.RoundTrip(req)
}

// Close stops the per-host table's background work.
func (p *Polite) Close() {
	if old := p.pace.Swap(nil); old != nil {
		old.hosts.StopAllGoroutines()
	}
}
