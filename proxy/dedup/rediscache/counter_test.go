package rediscache

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/countertest"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestTakeCountsFleetWide: one allowance spent by every instance, by
// Redis's clock.
func TestTakeCountsFleetWide(t *testing.T) {
	f := newFleet(t, 2, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {})
	countertest.Agree(t, f.insts[0].bus, f.insts[1].bus)
}

// TestForeignCounterValues: what another program left in a client's key
// (not a number, another type, a time far ahead) neither fails the rate
// limiter's step, which the breaker would count as Redis failing, nor
// holds the client back for longer than a burst.
func TestForeignCounterValues(t *testing.T) {
	f := newFleet(t, 1, Config{BreakerInterval: time.Minute}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {})
	a := f.insts[0]
	ctx := context.Background()
	rc := f.redis.Client()
	p := a.bus.prefix
	rc.Set(ctx, p+"gcra:words", "many", 0)
	rc.Set(ctx, p+"gcra:nan", "nan", 0)
	rc.HSet(ctx, p+"gcra:hash", "n", 1)
	rc.Set(ctx, p+"gcra:far", "99999999999999999999", 0)
	for _, key := range []string{"gcra:words", "gcra:nan", "gcra:hash"} {
		for i := range 3 {
			if ahead, ok, err := a.bus.Take(ctx, key, time.Second, 2*time.Second); err != nil || ok != (i < 2) {
				t.Errorf("%s: take %d = %s %v %v, want a whole burst of 2", key, i+1, ahead, ok, err)
			}
		}
	}
	if ahead, ok, err := a.bus.Take(ctx, "gcra:far", time.Second, time.Minute); err != nil || ok || ahead != time.Minute {
		t.Errorf("a time far ahead: %s %v %v, want refused, a burst (1m) ahead", ahead, ok, err)
	}
	if ttl := rc.PTTL(ctx, p+"gcra:words").Val(); ttl <= 0 || ttl > 3*time.Second {
		t.Errorf("a client's key lives %s, want until its time has passed (2s) and a second", ttl)
	}
	if !a.be.Available() {
		t.Fatal("foreign counter values switched the shared layer off")
	}
}
