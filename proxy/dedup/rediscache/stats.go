package rediscache

import (
	"context"
	"errors"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// statsDays is how long per-day counters are kept.
const statsDays = 7

// Record implements dedup.Recorder: the counts wait in memory for the
// next flush.
func (s *Bus) Record(xcache string, avoided int, moneyNano int64) {
	s.stats.Record(xcache, avoided, moneyNano)
}

func (s *Bus) dayKey(t time.Time) string {
	return s.prefix + "stats:" + t.UTC().Format("2006-01-02")
}

func (s *Bus) flushStats(ctx context.Context) {
	t := time.NewTicker(s.cfg.StatsFlush)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			// Last flush on shutdown, briefly: counts of the final second.
			fctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
			s.flushOnce(fctx)
			cancel()
			return
		case <-t.C:
			s.flushOnce(ctx)
		}
	}
}

// flushOnce adds the buffered counts to today's hash. Counts whose command
// got no answer are put back for the next flush; those Redis refused (a
// field that is not a number: not written by onceproxy) replace the field.
// The pipeline is no transaction: the counts Redis added stay added, and
// putting them back too would count them twice.
func (s *Bus) flushOnce(ctx context.Context) {
	fields := []struct {
		name string
		v    *atomic.Int64
	}{
		{"hit", &s.stats.Hit}, {"coalesced", &s.stats.Coalesced},
		{"miss", &s.stats.Miss}, {"bypass", &s.stats.Bypass}, {"bytes_avoided", &s.stats.Avoided}, {"money_nano", &s.stats.MoneyNano},
	}
	taken := make([]int64, len(fields))
	nonzero := false
	for i, f := range fields {
		taken[i] = f.v.Swap(0)
		nonzero = nonzero || taken[i] != 0
	}
	if !nonzero {
		return
	}
	key := s.dayKey(time.Now())
	incrs := make([]*redis.IntCmd, len(fields))
	// Each count's fate is on its own command (nil: never sent).
	_ = s.exec(ctx, func(ctx context.Context) error {
		_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, f := range fields {
				if taken[i] != 0 {
					incrs[i] = p.HIncrBy(ctx, key, f.name, taken[i])
				}
			}
			p.Expire(ctx, key, (statsDays+1)*24*time.Hour)
			return nil
		})
		return err
	})
	var refused []any
	for i, f := range fields {
		switch {
		case taken[i] == 0:
		case incrs[i] == nil:
			f.v.Add(taken[i]) // never sent (the breaker is open)
		case incrs[i].Err() == nil:
			// Added.
		case isReply(incrs[i].Err()):
			s.rejected.Add(1)
			refused = append(refused, f.name, taken[i])
		default:
			f.v.Add(taken[i]) // no answer: the next flush tries again
		}
	}
	if len(refused) > 0 {
		s.log.Warn("redis: a fleet counter held something else than a number; replacing it", "key", key)
		_ = s.exec(ctx, func(ctx context.Context) error { return s.rdb.HSet(ctx, key, refused...).Err() })
	}
}

// isReply reports whether err is Redis's answer to a command (it refused
// it), rather than a failure to get one.
func isReply(err error) bool {
	var re redis.Error
	return errors.As(err, &re) && !errors.Is(err, redis.Nil)
}

// FleetStats reads the last seven days of counters.
func (s *Bus) FleetStats(ctx context.Context) (dedup.FleetStats, error) {
	now := time.Now()
	cmds := make([]*redis.MapStringStringCmd, statsDays)
	err := s.exec(ctx, func(ctx context.Context) error {
		_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i := range statsDays {
				cmds[i] = p.HGetAll(ctx, s.dayKey(now.AddDate(0, 0, -i)))
			}
			return nil
		})
		return err
	})
	fs := dedup.FleetStats{Store: "redis", Available: s.available()}
	if err != nil {
		return fs, err
	}
	sum := map[string]int64{}
	for i, c := range cmds {
		d := dayStats(now.AddDate(0, 0, -i).UTC().Format("2006-01-02"), c.Val())
		if i == 0 {
			fs.Today = d
		}
		fs.Days = append(fs.Days, d)
		for k, v := range c.Val() {
			n, _ := strconv.ParseInt(v, 10, 64)
			sum[k] += n
		}
	}
	raw := map[string]string{}
	for k, v := range sum {
		raw[k] = strconv.FormatInt(v, 10)
	}
	fs.Last7Days = dayStats("last_7_days", raw)
	return fs, nil
}

func dayStats(date string, raw map[string]string) dedup.DayStats {
	n := func(k string) int64 { v, _ := strconv.ParseInt(raw[k], 10, 64); return v }
	return dedup.NewDayStats(date, n("hit"), n("coalesced"), n("miss"), n("bypass"), n("bytes_avoided"), n("money_nano"))
}
