package rediscache

import (
	"context"
	"strconv"
	"strings"
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

// addScript adds a batch of counts (dedup.DayBatch) to its day's hash
// once: beside the hash, a mark keeps the last batch each instance added,
// so a batch sent again because its answer never came is not added twice.
// A counter that holds something else than a number (not written by
// onceproxy) is replaced by the batch's count, and a day or mark of
// another type is removed; the names of what was replaced are returned
// ("" for a removed day).
// KEYS: the day's hash, this instance's mark. ARGV: the batch's id, the
// day's life (s), then name, count pairs.
var addScript = redis.NewScript(`
local function ours(key, kind)
  local t = redis.call('TYPE', key).ok
  if t ~= 'none' and t ~= kind then redis.call('DEL', key) return false end
  return true
end
ours(KEYS[2], 'string')
if redis.call('GET', KEYS[2]) == ARGV[1] then return {} end
local replaced = {}
if not ours(KEYS[1], 'hash') then table.insert(replaced, '') end
for i = 3, #ARGV, 2 do
  local r = redis.pcall('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
  if type(r) == 'table' and r.err then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    table.insert(replaced, ARGV[i])
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
return replaced
`)

// flushOnce adds the counts taken since the last flush to their day's
// hash, exactly once (dedup.DayCounts): a batch whose answer never came
// goes again, as it was, at the next flush, before the newer counts.
func (s *Bus) flushOnce(ctx context.Context) {
	err := s.stats.Flush(time.Now(), func(b dedup.DayBatch) error {
		day := s.dayKey(b.Day)
		args := []any{b.ID, int64((statsDays + 1) * 24 * time.Hour / time.Second)}
		for i, n := range b.Counts {
			if n != 0 {
				args = append(args, dedup.Fields[i], n)
			}
		}
		var replaced []string
		err := s.exec(ctx, func(ctx context.Context) error {
			var err error
			replaced, err = addScript.Run(ctx, s.rdb, []string{day, sameSlot(day, ":added:"+s.instance)}, args...).StringSlice()
			return err
		})
		if err == nil && len(replaced) > 0 {
			s.rejected.Add(int64(len(replaced)))
			s.log.Warn("redis: a fleet counter held something else than a number; replaced it", "key", day, "fields", replaced)
		}
		return err
	})
	if err != nil {
		s.log.Debug("redis: fleet counters not flushed; sending them again at the next flush", "err", err)
	}
}

// sameSlot names a key in key's Redis Cluster slot: key with suffix when
// key has a hash tag of its own, else key made the tag. Config.Validate
// refuses a key prefix with a brace; a key with an unmatched one (from a
// Config never validated) can have neither, and on a Cluster a script
// over both keys then fails (CROSSSLOT), and says so.
func sameSlot(key, suffix string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key + suffix
		}
	}
	if strings.ContainsAny(key, "{}") {
		return key + suffix
	}
	return "{" + key + "}" + suffix
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
