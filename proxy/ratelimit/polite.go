package ratelimit

import (
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/maypok86/otter/v2"
	"golang.org/x/time/rate"
)

// Polite paces requests to each target host: a token bucket per host
// (PerHostRPS, PerHostBurst) shared by every client of this process. A
// request waits for its turn, bounded by its context (the flight deadline);
// it is never refused outright. It sits in front of the upstream, behind
// dedup, so only requests that really go upstream are paced.
type Polite struct {
	next  http.RoundTripper
	rps   rate.Limit
	burst int
	hosts *otter.Cache[string, *rate.Limiter]
}

// NewPolite wraps next; with cfg.PerHostRPS == 0 requests pass straight
// through (and no per-host table is kept).
func NewPolite(cfg Config, next http.RoundTripper) *Polite {
	cfg = cfg.WithDefaults()
	if cfg.PerHostRPS <= 0 {
		return &Polite{next: next}
	}
	return &Polite{
		next:  next,
		rps:   rate.Limit(cfg.PerHostRPS),
		burst: cfg.PerHostBurst,
		hosts: otter.Must(&otter.Options[string, *rate.Limiter]{
			MaximumSize:      50_000,
			ExpiryCalculator: otter.ExpiryAccessing[string, *rate.Limiter](10 * time.Minute),
		}),
	}
}

// RoundTrip implements http.RoundTripper.
func (p *Polite) RoundTrip(req *http.Request) (*http.Response, error) {
	if p.hosts == nil {
		return p.next.RoundTrip(req)
	}
	host := strings.ToLower(req.URL.Hostname())
	lim, _ := p.hosts.ComputeIfAbsent(host, func() (*rate.Limiter, bool) { return rate.NewLimiter(p.rps, p.burst), false })
	if err := lim.Wait(req.Context()); err != nil {
		return nil, fmt.Errorf("ratelimit: waiting for a turn at %s (per_host_rps %v): %w", host, float64(p.rps), err)
	}
	return p.next.RoundTrip(req)
}

// Close stops the per-host table's background work.
func (p *Polite) Close() {
	if p.hosts != nil {
		p.hosts.StopAllGoroutines()
	}
}
