package dedup

import (
	"crypto/rand"
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// X-Cache values: HIT (served from the cache, no upstream request),
// COALESCED (waited on an identical request in flight, here or on another
// instance), MISS (went upstream; stored if cacheable), BYPASS (went
// upstream without dedup: not dedupable, too large, or the shared store is
// away).
const (
	CacheHit       = "HIT"
	CacheCoalesced = "COALESCED"
	CacheMiss      = "MISS"
	CacheBypass    = "BYPASS"
)

// Response headers the engine sets.
const (
	HeaderCache    = "X-Cache"
	HeaderCacheKey = "X-Cache-Key"
)

// counters are the engine's running totals.
type counters struct {
	// answers counts answers by X-Cache, body bytes avoided and money
	// saved (in billionths of the currency), as the stores' per-day
	// counters do.
	answers  DayCounts
	upstream atomic.Uint64 // requests actually sent upstream
	flights  atomic.Int64  // flights fetching right now
	waiters  atomic.Int64  // requests waiting on a flight right now
	sharing  atomic.Int64  // flights whose clients have their answer, which the fleet's store is taking
	// Flights that read their body from another instance: whole from it
	// (ok), from the origin after all (fallback: the peer could not be
	// asked or failed mid-body), or neither (failed).
	peerOK, peerFallback, peerFailed atomic.Uint64
}

// Stats is a snapshot of what deduplication saved, for /cache/stats.
// by_source uses the names CAPTCHA-solver dedup layers report savings in:
// api (went upstream), dedup_cache (HIT), dedup_wait (COALESCED).
type Stats struct {
	Requests         uint64            `json:"requests"`
	XCache           map[string]uint64 `json:"x_cache"`
	BySource         map[string]uint64 `json:"by_source"`
	UpstreamRequests uint64            `json:"upstream_requests"`
	RequestsAvoided  uint64            `json:"upstream_requests_avoided"`
	BytesAvoided     uint64            `json:"bytes_avoided"`
	SavingsPct       float64           `json:"savings_pct"`
	// MoneySaved is requests avoided times the per-request price plus
	// bytes avoided times the per-GB price, in Currency.
	MoneySaved float64 `json:"money_saved"`
	Currency   string  `json:"currency"`
	Flights    int64   `json:"flights_in_progress"`
	Waiters    int64   `json:"flight_waiters"`
	// Sharing counts the flights, among Flights, whose clients have
	// their answer while the fleet's store takes it (a round trip, or
	// longer when the store is slow).
	Sharing int64      `json:"flights_sharing"`
	Store   StoreStats `json:"store"`
	// Disk is the disk tier; nil when it is off.
	Disk  *StoreStats `json:"disk,omitempty"`
	Spool SpoolStats  `json:"spool"`
	// PeerFetches counts this instance's flights that read their body
	// from the instance downloading it.
	PeerFetches PeerStats `json:"peer_fetches"`
}

// PeerStats counts flights that read their body from another instance.
type PeerStats struct {
	// OK: the peer served the whole body.
	OK uint64 `json:"ok"`
	// Fallback: the peer could not be asked (refused, timeout, a bad
	// token, nothing held) or failed mid-body, and the body came from the
	// origin: one more download.
	Fallback uint64 `json:"fallback"`
	// A fallback mid-body that the origin cannot finish with the same
	// bytes is still an error for the readers, never a spliced body.
	// Failed: the peer failed mid-body and the body could not be asked
	// for again (not a plain GET, or the flight was ending).
	Failed uint64 `json:"failed"`
}

// SpoolStats describes the bodies being downloaded or still being read.
type SpoolStats struct {
	Active      int64 `json:"active"`       // spools alive
	Files       int64 `json:"files"`        // of them, spilled to a file
	MemoryBytes int64 `json:"memory_bytes"` // memory they hold
	MaxMemory   int64 `json:"max_memory_bytes"`
	DiskBytes   int64 `json:"disk_bytes"` // what their files hold
	MaxDisk     int64 `json:"max_disk_bytes"`
}

func (c *counters) snapshot() Stats {
	a := &c.answers
	hit, co, miss, by := uint64(a.Hit.Load()), uint64(a.Coalesced.Load()), uint64(a.Miss.Load()), uint64(a.Bypass.Load())
	s := Stats{
		Requests:         hit + co + miss + by,
		XCache:           map[string]uint64{CacheHit: hit, CacheCoalesced: co, CacheMiss: miss, CacheBypass: by},
		BySource:         map[string]uint64{"api": miss + by, "dedup_cache": hit, "dedup_wait": co},
		UpstreamRequests: c.upstream.Load(),
		RequestsAvoided:  hit + co,
		BytesAvoided:     uint64(a.Avoided.Load()),
		MoneySaved:       float64(a.MoneyNano.Load()) / 1e9,
		Flights:          c.flights.Load(),
		Waiters:          c.waiters.Load(),
		Sharing:          c.sharing.Load(),
		PeerFetches:      PeerStats{OK: c.peerOK.Load(), Fallback: c.peerFallback.Load(), Failed: c.peerFailed.Load()},
	}
	s.SavingsPct = savingsPct(hit+co, s.Requests)
	return s
}

// savingsPct is (HIT + COALESCED) / all, in percent with one decimal.
func savingsPct[T int64 | uint64](saved, all T) float64 {
	if all <= 0 {
		return 0
	}
	return float64(int64(float64(saved)*1000/float64(all)+0.5)) / 10
}

// DayCounts are one instance's counts between two flushes to a shared
// store's per-day counters: one write per flush instead of one per
// request. The zero value is ready.
//
// A flush whose write got no answer cannot tell whether the store added
// the counts: putting them back would count them twice when it did, and
// dropping them would lose them when it did not. So counts leave in
// batches with an id of their own, a batch whose fate is unknown is sent
// again as it is, under the same id, before any newer counts (Flush), and
// the store adds a batch only if it has not added that id
// already: each answer is counted exactly once.
type DayCounts struct {
	Hit, Coalesced, Miss, Bypass, Avoided, MoneyNano atomic.Int64

	mu      sync.Mutex
	pending *DayBatch // taken, not known to be added
}

// DayBatch is counts on their way to a shared store's day. Its ID is
// unique to it: an instance's batches go one at a time, so a store need
// only remember the last ID it added for each instance.
type DayBatch struct {
	ID  string
	Day time.Time // the UTC day the counts were taken, at midnight
	// Counts is hit, coalesced, miss, bypass, bytes avoided and money
	// saved in billionths, in that order (Fields names them).
	Counts [6]int64
}

// Fields names a DayBatch's counts, in order, as the stores keep them.
var Fields = [6]string{"hit", "coalesced", "miss", "bypass", "bytes_avoided", "money_nano"}

// Flush hands add the batches to write, one at a time: first the last
// one, if its fate is unknown, as it was, then the counts recorded since.
// add returns nil once the store has added the batch; on an error it
// stops, and the batch goes again at the next Flush.
func (c *DayCounts) Flush(now time.Time, add func(DayBatch) error) error {
	for range 2 { // the batch sent again, then the newer counts
		b, ok := c.take(now)
		if !ok {
			return nil
		}
		err := add(b)
		c.settle(err == nil)
		if err != nil {
			return err
		}
	}
	return nil
}

// take returns the batch to write: the last one taken, if its fate is
// unknown, else the counts recorded since (false when there are none).
// Every take is followed by a settle.
func (c *DayCounts) take(now time.Time) (DayBatch, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pending != nil {
		return *c.pending, true
	}
	b := DayBatch{Day: now.UTC().Truncate(24 * time.Hour), ID: rand.Text()}
	nonzero := false
	for i, v := range c.fields() {
		b.Counts[i] = v.Swap(0)
		nonzero = nonzero || b.Counts[i] != 0
	}
	if !nonzero {
		return DayBatch{}, false
	}
	c.pending = &b
	return b, true
}

// settle says whether the store added the batch take returned: if not,
// or if that is unknown, it is taken again by the next take.
func (c *DayCounts) settle(added bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if added {
		c.pending = nil
	}
}

func (c *DayCounts) fields() [6]*atomic.Int64 {
	return [6]*atomic.Int64{&c.Hit, &c.Coalesced, &c.Miss, &c.Bypass, &c.Avoided, &c.MoneyNano}
}

// Record counts one response, as a Recorder does. It runs for every
// answer: an add of nothing is skipped.
func (c *DayCounts) Record(xcache string, avoided int, moneyNano int64) {
	if moneyNano != 0 {
		addSaturating(&c.MoneyNano, moneyNano)
	}
	switch xcache {
	case CacheHit:
		c.Hit.Add(1)
	case CacheCoalesced:
		c.Coalesced.Add(1)
	case CacheMiss:
		c.Miss.Add(1)
	case CacheBypass:
		c.Bypass.Add(1)
	}
	if avoided > 0 {
		c.Avoided.Add(int64(avoided))
	}
}

// NewDayStats is the report of one day (or span) of a shared store's
// counters: answers by X-Cache, body bytes avoided and money saved in
// billionths.
func NewDayStats(date string, hit, coalesced, miss, bypass, bytesAvoided, moneyNano int64) DayStats {
	d := DayStats{
		Date:         date,
		Requests:     hit + coalesced + miss + bypass,
		XCache:       map[string]int64{CacheHit: hit, CacheCoalesced: coalesced, CacheMiss: miss, CacheBypass: bypass},
		BySource:     map[string]int64{"api": miss + bypass, "dedup_cache": hit, "dedup_wait": coalesced},
		BytesAvoided: bytesAvoided,
		MoneySaved:   float64(moneyNano) / 1e9,
	}
	d.SavingsPct = savingsPct(hit+coalesced, d.Requests)
	return d
}

// DayStats is one day of fleet-wide counters, as a shared store keeps them.
type DayStats struct {
	Date         string           `json:"date"`
	Requests     int64            `json:"requests"`
	XCache       map[string]int64 `json:"x_cache"`
	BySource     map[string]int64 `json:"by_source"`
	BytesAvoided int64            `json:"bytes_avoided"`
	SavingsPct   float64          `json:"savings_pct"`
	// MoneySaved is what the fleet's HIT and COALESCED answers saved, in
	// the savings currency.
	MoneySaved float64 `json:"money_saved"`
}

// FleetStats is the whole fleet's savings, from every instance's counters
// in the shared store.
type FleetStats struct {
	// Store names the shared store ("redis"); Available is false while
	// it is away (its breaker is open).
	Store     string     `json:"store"`
	Available bool       `json:"available"`
	Today     DayStats   `json:"today"`
	Last7Days DayStats   `json:"last_7_days"`
	Days      []DayStats `json:"days"`
}

// addSaturating adds n (positive) to v, stopping at the most an int64
// holds: the money saved is a counter, and one wrapped below zero by a
// sum of large savings would go back (pgstore saturates its sum too).
func addSaturating(v *atomic.Int64, n int64) {
	for {
		old := v.Load()
		sum := old + n
		if sum < old {
			sum = math.MaxInt64
		}
		if sum == old || v.CompareAndSwap(old, sum) {
			return
		}
	}
}
