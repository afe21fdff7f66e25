package upstream

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestMarkArithmetic walks a session through sequences of outcomes on an
// injected clock and checks weight, consecutive failures and cooldown.
func TestMarkArithmetic(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	type step struct {
		at         time.Duration // after t0
		o          outcome
		retryAfter time.Duration
	}
	for _, tc := range []struct {
		name     string
		start    int
		steps    []step
		weight   int
		failures int
		cooling  time.Duration // cooldown end after t0; 0 = none
		reason   outcome
	}{
		{"success raises", 5, []step{{0, outcomeOK, 0}}, 6, 0, 0, outcomeNone},
		{"success caps at 10", 10, []step{{0, outcomeOK, 0}}, 10, 0, 0, outcomeNone},
		{"429: -2, 60s", 5, []step{{0, outcomeRateLimited, 0}}, 3, 1, 60 * time.Second, outcomeRateLimited},
		{"ban: -2, 60s", 5, []step{{0, outcomeBanned, 0}}, 3, 1, 60 * time.Second, outcomeBanned},
		{"429 with Retry-After 120", 5, []step{{0, outcomeRateLimited, 120 * time.Second}}, 3, 1, 120 * time.Second, outcomeRateLimited},
		{"Retry-After shorter than 60s", 5, []step{{0, outcomeRateLimited, 5 * time.Second}}, 3, 1, 60 * time.Second, outcomeRateLimited},
		{"Retry-After capped at 1h", 5, []step{{0, outcomeRateLimited, 48 * time.Hour}}, 3, 1, time.Hour, outcomeRateLimited},
		{"connection error: -3, 300s", 5, []step{{0, outcomeConnError, 0}}, 2, 1, 300 * time.Second, outcomeConnError},
		{"5xx: -1, no cooldown, no failure", 5, []step{{0, outcomeServerError, 0}}, 4, 0, 0, outcomeNone},
		{"weight floor is 1", 5, []step{{0, outcomeConnError, 0}, {time.Second, outcomeConnError, 0}}, 1, 2, 301 * time.Second, outcomeConnError},
		{"3 consecutive failures: 10 min", 10, []step{
			{0, outcomeRateLimited, 0}, {time.Minute, outcomeBanned, 0}, {2 * time.Minute, outcomeRateLimited, 0},
		}, 4, 3, 2*time.Minute + 10*time.Minute, outcomeRateLimited},
		{"5xx in a row never bench", 5, []step{
			{0, outcomeServerError, 0}, {time.Second, outcomeServerError, 0}, {2 * time.Second, outcomeServerError, 0},
		}, 2, 0, 0, outcomeNone},
		{"5xx neither add to nor break a streak", 10, []step{
			{0, outcomeRateLimited, 0}, {time.Minute, outcomeServerError, 0}, {2 * time.Minute, outcomeRateLimited, 0},
		}, 5, 2, 3 * time.Minute, outcomeRateLimited},
		{"success clears failures and cooldown", 5, []step{
			{0, outcomeRateLimited, 0}, {time.Second, outcomeOK, 0},
		}, 4, 0, 0, outcomeNone},
		{"success breaks the streak", 5, []step{
			{0, outcomeConnError, 0}, {time.Hour, outcomeConnError, 0}, {2 * time.Hour, outcomeOK, 0}, {3 * time.Hour, outcomeConnError, 0},
		}, 1, 1, 3*time.Hour + 300*time.Second, outcomeConnError},
		{"a milder failure never shortens a cooldown", 5, []step{
			{0, outcomeConnError, 0}, {10 * time.Second, outcomeRateLimited, 0},
		}, 1, 2, 300 * time.Second, outcomeConnError},
		{"a longer one extends it", 5, []step{
			{0, outcomeRateLimited, 0}, {10 * time.Second, outcomeConnError, 0},
		}, 1, 2, 310 * time.Second, outcomeConnError},
		{"none changes nothing", 5, []step{{0, outcomeNone, 0}}, 5, 0, 0, outcomeNone},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var h health
			h.init(tc.start)
			for _, st := range tc.steps {
				h.mark(st.o, t0.Add(st.at), st.retryAfter, "")
			}
			s := h.snapshot()
			if s.weight != tc.weight || s.failures != tc.failures {
				t.Errorf("weight %d failures %d, want %d and %d", s.weight, s.failures, tc.weight, tc.failures)
			}
			if int(h.aWeight.Load()) != s.weight {
				t.Errorf("atomic weight %d != %d", h.aWeight.Load(), s.weight)
			}
			var wantUntil time.Time
			if tc.cooling > 0 {
				wantUntil = t0.Add(tc.cooling)
			}
			if !s.coolUntil.Equal(wantUntil) || s.coolReason != tc.reason {
				t.Errorf("cooldown until %v (%s), want %v (%s)", s.coolUntil, s.coolReason, wantUntil, tc.reason)
			}
			if tc.cooling > 0 {
				end := t0.Add(tc.cooling)
				if h.available(end.Add(-time.Nanosecond).UnixNano()) || !h.available(end.UnixNano()) {
					t.Errorf("available() does not flip at the end of the cooldown")
				}
			} else if !h.available(t0.UnixNano()) {
				t.Errorf("not available without a cooldown")
			}
		})
	}
}

func TestCoolingForOriginSkipsProbes(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	var h health
	h.init(5)
	h.mark(outcomeConnError, t0, 0, "")
	if h.coolingForOrigin(t0) {
		t.Error("a connection-error cooldown must be probed (a probe can end it)")
	}
	h.mark(outcomeRateLimited, t0, 400*time.Second, "")
	if !h.coolingForOrigin(t0) {
		t.Error("a 429 cooldown must not be probed")
	}
	if h.coolingForOrigin(t0.Add(time.Hour)) {
		t.Error("an ended cooldown is not cooling")
	}
}

func TestRetryAfter(t *testing.T) {
	now := time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		in   string
		want time.Duration
	}{
		{"", 0},
		{"120", 120 * time.Second},
		{" 7 ", 7 * time.Second},
		{"0", 0},
		{"-5", 0},
		{"999999999", time.Hour},
		{"10000000000", time.Hour},          // overflowed time.Duration when multiplied
		{"99999999999999999999", time.Hour}, // past int64
		{"-99999999999999999999", 0},
		{now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second},
		{now.Add(-time.Minute).Format(http.TimeFormat), 0},
		{"soon", 0},
	} {
		if got := retryAfter(tc.in, now); got != tc.want {
			t.Errorf("retryAfter(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

func TestDecodePrefixOfTruncatedBodies(t *testing.T) {
	page := "<html>" + strings.Repeat("x", 1000) + "Access denied: captcha-wall" + strings.Repeat("y", 300_000) + "</html>"
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write([]byte(page))
	zw.Close()
	// Only a prefix of the compressed stream, as scanBody reads it.
	prefix := gz.Bytes()[:min(gz.Len(), 300)]
	if !bytes.Contains(decodePrefix(prefix, "gzip"), []byte("captcha-wall")) {
		t.Error("needle not found in a truncated gzip prefix")
	}
	if !bytes.Contains(decodePrefix([]byte(page[:2000]), ""), []byte("captcha-wall")) {
		t.Error("needle not found in identity body")
	}
	if bytes.Contains(decodePrefix([]byte("garbage"), "gzip"), []byte("captcha")) {
		t.Error("corrupt gzip produced text")
	}
}

// TestOneWallOneFailure: requests in flight together when a 429 comes back
// meet the same wall. The first failure benches the session; the others,
// sent before that cooldown began, add neither failures nor penalties (ten
// of them used to escalate it to the ten-minute cooldown at once), but a
// Retry-After of their own still lengthens the cooldown.
func TestOneWallOneFailure(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	var h health
	h.init(5)
	since := h.epoch() // every request below was sent before the wall
	for i := range 10 {
		h.markSince(outcomeRateLimited, t0.Add(time.Duration(i)*time.Millisecond), 0, "", since, "", false)
	}
	h.markSince(outcomeConnError, t0.Add(20*time.Millisecond), 0, "tunnel cut by the rotation", since, "", false)
	s := h.snapshot()
	if s.weight != 3 || s.failures != 1 || !s.coolUntil.Equal(t0.Add(time.Minute)) || s.coolReason != outcomeRateLimited {
		t.Fatalf("after one wall met 11 times: weight %d failures %d cooldown %v (%s), want 3, 1, %v (rate_limited)",
			s.weight, s.failures, s.coolUntil, s.coolReason, t0.Add(time.Minute))
	}
	if d := h.markSince(outcomeRateLimited, t0.Add(30*time.Millisecond), 10*time.Minute, "", since, "", false); d != 10*time.Minute {
		t.Errorf("a Retry-After of 10m in the same wall cooled for %v", d)
	}
	if s := h.snapshot(); s.failures != 1 || !s.coolUntil.Equal(t0.Add(30*time.Millisecond+10*time.Minute)) {
		t.Errorf("after its Retry-After: failures %d cooldown %v", s.failures, s.coolUntil)
	}
	// A request sent after the cooldown ended is a new wall.
	later := t0.Add(time.Hour)
	h.markSince(outcomeRateLimited, later, 0, "", h.epoch(), "", false)
	if s := h.snapshot(); s.failures != 2 || !s.coolUntil.Equal(later.Add(time.Minute)) {
		t.Errorf("a later 429: failures %d cooldown %v, want 2 and %v", s.failures, s.coolUntil, later.Add(time.Minute))
	}
}

// TestSiteCooldownArithmetic: an origin's 429 or ban benches the session
// at that site only, escalates after three walls there, ends with a
// success there, and the sites kept stay within maxSites.
func TestSiteCooldownArithmetic(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	var h health
	h.init(10)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	h.markSince(outcomeRateLimited, at(0), 0, "", h.epoch(), "a.example:443", true)
	if !h.available(at(0).UnixNano()) || !h.siteCooling("a.example:443", at(0).UnixNano()) ||
		h.siteCooling("b.example:443", at(0).UnixNano()) || !h.siteCooling("a.example:443", at(time.Minute-1).UnixNano()) ||
		h.siteCooling("a.example:443", at(time.Minute).UnixNano()) {
		t.Fatalf("after a 429 at a.example: the session, a.example for a minute, b.example free")
	}
	if s := h.snapshot(); s.failures != 0 || s.weight != 8 {
		t.Errorf("a site's 429 is no failure of the session's own: failures %d weight %d", s.failures, s.weight)
	}
	// Two more walls there, each after the last cooldown ended: the third
	// escalates, at that site.
	h.markSince(outcomeBanned, at(2*time.Minute), 0, "", h.epoch(), "a.example:443", true)
	h.markSince(outcomeRateLimited, at(4*time.Minute), 0, "", h.epoch(), "a.example:443", true)
	if !h.siteCooling("a.example:443", at(4*time.Minute+9*time.Minute).UnixNano()) || !h.available(at(5*time.Minute).UnixNano()) {
		t.Fatalf("three walls at a.example: want 10 minutes there, the session free")
	}
	// A success there ends it, and its count.
	h.markSince(outcomeOK, at(20*time.Minute), 0, "", h.epoch(), "a.example:443", true)
	h.markSince(outcomeRateLimited, at(21*time.Minute), 0, "", h.epoch(), "a.example:443", true)
	if h.siteCooling("a.example:443", at(22*time.Minute).UnixNano()) {
		t.Fatalf("after a success at a.example, a 429 there escalated: its walls were not reset")
	}
	// A 429 without a site (a gateway's) benches the session for all.
	h.markSince(outcomeRateLimited, at(30*time.Minute), 0, "", h.epoch(), "", false)
	if h.available(at(30 * time.Minute).UnixNano()) {
		t.Fatalf("a gateway's 429 did not bench the session")
	}
	// Bounded: the sites past maxSites make room.
	for i := range maxSites + 50 {
		h.markSince(outcomeRateLimited, at(40*time.Minute), time.Duration(i+1)*time.Second, "", h.epoch(), fmt.Sprintf("s%d.example:443", i), true)
	}
	h.mu.Lock()
	n := len(h.sites)
	h.mu.Unlock()
	if n > maxSites {
		t.Errorf("%d sites kept, bound %d", n, maxSites)
	}
	if !h.siteCooling(fmt.Sprintf("s%d.example:443", maxSites+49), at(40*time.Minute).UnixNano()) {
		t.Errorf("the newest site was not kept")
	}
}

// TestSiteWallSwallowsItsCutTunnels: requests in flight to a site when it
// answers 429 end in connection errors once the rotation that follows
// cuts their tunnels. Those are the site's wall too (they went to it, and
// began before its cooldown): counted as the session's own failures, nine
// of them escalated it to the ten-minute bench for every site.
func TestSiteWallSwallowsItsCutTunnels(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	var h health
	h.init(5)
	since := h.epoch()
	h.markSince(outcomeRateLimited, t0, 0, "", since, "a.example:443", true)
	for i := range 9 {
		h.markSince(outcomeConnError, t0.Add(time.Duration(i+1)*time.Millisecond), 0, "tunnel cut", since, "a.example:443", false)
	}
	s := h.snapshot()
	if s.failures != 0 || s.weight != 3 || !h.available(t0.Add(time.Second).UnixNano()) {
		t.Fatalf("after one site's wall and its cut tunnels: failures %d weight %d available %v, want 0, 3 and the session free",
			s.failures, s.weight, h.available(t0.Add(time.Second).UnixNano()))
	}
	// One to another site counts, even begun before the wall.
	h.markSince(outcomeConnError, t0.Add(time.Second), 0, "", since, "b.example:443", false)
	if s := h.snapshot(); s.failures != 1 {
		t.Errorf("failures %d, want the other site's 1", s.failures)
	}
}
