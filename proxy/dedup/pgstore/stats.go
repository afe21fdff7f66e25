package pgstore

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// statsDays is how long per-day counters are reported (the sweep keeps a
// day more, so the oldest day is whole).
const statsDays = 7

// Record implements dedup.Recorder: the counts wait in memory for the
// next flush.
func (b *Bus) Record(xcache string, avoided int, moneyNano int64) {
	b.stats.Record(xcache, avoided, moneyNano)
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

// flushOnce adds the counts taken since the last flush to their day's
// row, exactly once (dedup.DayCounts): a batch whose answer never came
// goes again, as it was, at the next flush, before the newer counts.
func (b *Bus) flushOnce(ctx context.Context) {
	err := b.stats.Flush(time.Now(), func(batch dedup.DayBatch) error {
		c := batch.Counts
		return b.exec(ctx, func(ctx context.Context) error {
			_, err := b.pool.Exec(ctx, b.sql.flushStats, batch.Day, c[0], c[1], c[2], c[3], c[4], c[5], b.instance, batch.ID)
			return err
		})
	})
	if err != nil {
		b.log.Debug("postgres: fleet counters not flushed; sending them again at the next flush", "err", err)
	}
}

// FleetStats reads the last seven days of counters.
func (b *Bus) FleetStats(ctx context.Context) (dedup.FleetStats, error) {
	today := day(time.Now())
	first := today.AddDate(0, 0, -(statsDays - 1))
	fs := dedup.FleetStats{Store: "postgres", Available: b.available()}
	rows := map[string][6]int64{}
	err := b.exec(ctx, func(ctx context.Context) error {
		r, err := b.pool.Query(ctx, b.sql.readStats, first, today)
		if err != nil {
			return err
		}
		var d time.Time
		var v [6]int64
		_, err = pgx.ForEachRow(r, []any{&d, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5]}, func() error {
			rows[d.Format(time.DateOnly)] = v
			return nil
		})
		return err
	})
	if err != nil {
		return fs, err
	}
	var sum [6]int64
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

// dayStats builds one day's report from hit, coalesced, miss, bypass,
// bytes avoided and money saved (billionths).
func dayStats(date string, v [6]int64) dedup.DayStats {
	return dedup.NewDayStats(date, v[0], v[1], v[2], v[3], v[4], v[5])
}
