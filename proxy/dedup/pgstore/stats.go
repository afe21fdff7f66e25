package pgstore

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// statsDays is how long per-day counters are reported (the sweep keeps a
// day more, so the oldest day is whole).
const statsDays = 7

// statsBuf accumulates this instance's counts between flushes: one
// statement per stats_flush instead of one per request.
type statsBuf struct {
	hit, coalesced, miss, bypass, avoided atomic.Int64
}

// Record implements dedup.Recorder.
func (b *Bus) Record(xcache string, avoided int) {
	switch xcache {
	case dedup.CacheHit:
		b.stats.hit.Add(1)
	case dedup.CacheCoalesced:
		b.stats.coalesced.Add(1)
	case dedup.CacheMiss:
		b.stats.miss.Add(1)
	case dedup.CacheBypass:
		b.stats.bypass.Add(1)
	}
	b.stats.avoided.Add(int64(avoided))
}

// day is the UTC date of t at midnight, as the stats table keys it.
func day(t time.Time) time.Time {
	y, m, d := t.UTC().Date()
	return time.Date(y, m, d, 0, 0, 0, 0, time.UTC)
}

func (b *Bus) flushStats(ctx context.Context) {
	t := time.NewTicker(b.cfg.StatsFlush)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			// Last flush on shutdown, briefly: counts of the final moment.
			fctx, cancel := context.WithTimeout(context.Background(), b.cfg.DialTimeout+b.cfg.Timeout)
			b.flushOnce(fctx)
			cancel()
			return
		case <-t.C:
			b.flushOnce(ctx)
		}
	}
}

// flushOnce adds the buffered counts to today's row. Counts that could not
// be written are put back for the next flush.
func (b *Bus) flushOnce(ctx context.Context) {
	fields := []*atomic.Int64{&b.stats.hit, &b.stats.coalesced, &b.stats.miss, &b.stats.bypass, &b.stats.avoided}
	taken := make([]int64, len(fields))
	nonzero := false
	for i, f := range fields {
		taken[i] = f.Swap(0)
		nonzero = nonzero || taken[i] != 0
	}
	if !nonzero {
		return
	}
	err := b.exec(ctx, func(ctx context.Context) error {
		_, err := b.pool.Exec(ctx, b.sql.flushStats, day(time.Now()), taken[0], taken[1], taken[2], taken[3], taken[4])
		return err
	})
	if err != nil {
		for i, f := range fields {
			f.Add(taken[i])
		}
	}
}

// FleetStats reads the last seven days of counters.
func (b *Bus) FleetStats(ctx context.Context) (dedup.FleetStats, error) {
	today := day(time.Now())
	first := today.AddDate(0, 0, -(statsDays - 1))
	fs := dedup.FleetStats{Store: "postgres", Available: b.available()}
	rows := map[string][5]int64{}
	err := b.exec(ctx, func(ctx context.Context) error {
		r, err := b.pool.Query(ctx, b.sql.readStats, first, today)
		if err != nil {
			return err
		}
		var d time.Time
		var v [5]int64
		_, err = pgx.ForEachRow(r, []any{&d, &v[0], &v[1], &v[2], &v[3], &v[4]}, func() error {
			rows[d.Format(time.DateOnly)] = v
			return nil
		})
		return err
	})
	if err != nil {
		return fs, err
	}
	var sum [5]int64
	for i := range statsDays {
		date := today.AddDate(0, 0, -i).Format(time.DateOnly)
		v := rows[date]
		d := dayStats(date, v)
		if i == 0 {
			fs.Today = d
		}
		fs.Days = append(fs.Days, d)
		for j := range v {
			sum[j] += v[j]
		}
	}
	fs.Last7Days = dayStats("last_7_days", sum)
	return fs, nil
}

// dayStats builds one day's report from hit, coalesced, miss, bypass and
// bytes avoided.
func dayStats(date string, v [5]int64) dedup.DayStats {
	hit, co, miss, by := v[0], v[1], v[2], v[3]
	d := dedup.DayStats{
		Date:         date,
		Requests:     hit + co + miss + by,
		XCache:       map[string]int64{dedup.CacheHit: hit, dedup.CacheCoalesced: co, dedup.CacheMiss: miss, dedup.CacheBypass: by},
		BySource:     map[string]int64{"api": miss + by, "dedup_cache": hit, "dedup_wait": co},
		BytesAvoided: v[4],
	}
	if d.Requests > 0 {
		d.SavingsPct = float64(int64(float64(hit+co)*1000/float64(d.Requests)+0.5)) / 10
	}
	return d
}
