package rediscache

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/fleetevent"
)

// Bus carries notes, claims and counters between the instances of a
// fleet: upstream session news (upstream.Bus, upstream.Claimer), the
// fleet-wide rate limit (ratelimit.Counter) and the per-day statistics
// (dedup.Recorder, FleetStats).
//
// Notes ride the events channel the flights already use, as
// "n <instance> <topic> <message>"; an instance ignores its own. Delivery is
// best effort, like everything on a Redis channel: a note lost while Redis
// is away costs the fleet what it would cost without Redis.
//
// A lasting note (a cooldown: true for a while) is also kept in Redis until
// it expires, so that an instance that subscribes later, or comes back
// after losing Redis, hears what the fleet knows.
type Bus struct {
	*client
	stats dedup.DayCounts // flushed each stats_flush

	topics fleetevent.Topics
	out    chan note
}

var _ dedup.Recorder = (*Bus)(nil)

// noteQueue bounds the notes waiting to be published: a burst (every
// session failing at once) never blocks a request or grows without bound.
const noteQueue = 256

func newBus(c *client) *Bus {
	b := &Bus{client: c, out: make(chan note, noteQueue)}
	// Notes sent while Redis was away were lost: catch up on the lasting
	// ones.
	c.onReconnect(b.recallAll)
	return b
}

// note is one note on its way out.
type note struct {
	topic, msg string
	key        string        // lasting notes: what it is about (one kept per key)
	ttl        time.Duration // lasting notes: how long it holds
}

// Publish sends msg on topic to the other instances; with ttl > 0 it is
// also kept for ttl under key (a later note on the same key replaces it
// unless it would expire sooner) for instances that subscribe later. It
// never blocks: with the queue full (Redis slow or away) the note is
// dropped.
func (b *Bus) Publish(topic, key, msg string, ttl time.Duration) {
	n := note{topic: topic, msg: msg}
	if ttl > 0 && key != "" {
		n.key, n.ttl = key, ttl
	}
	select {
	case b.out <- n:
	default:
		b.log.Debug("redis: note dropped, queue full", "topic", topic)
	}
}

// Subscribe makes f receive the notes other instances publish on topic, on
// the events goroutine (f must be quick), and the lasting notes that still
// hold: before Subscribe returns (bounded by redis.timeout) and again each
// time Redis comes back after an outage. One handler per topic.
func (b *Bus) Subscribe(topic string, f func(msg string, left time.Duration)) {
	b.topics.Set(topic, f)
	b.recall(b.life, topic, f)
}

// keepScript keeps a lasting note in the topic's hash as "<until> <msg>",
// until in Redis's own clock (instances' clocks need not agree), unless
// the note already kept for that key lasts longer.
var keepScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local untl = now + ttl
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old then
  local ou = tonumber(string.match(old, '^(%d+) '))
  if ou and ou >= untl then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], untl .. ' ' .. ARGV[3])
if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
return 1
`)

// recallScript returns the topic's lasting notes that still hold, each with
// the milliseconds it has left, and drops the expired ones.
var recallScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #all, 2 do
  local untl, msg = string.match(all[i + 1], '^(%d+) (.*)$')
  if untl and tonumber(untl) > now then
    table.insert(out, msg)
    table.insert(out, tonumber(untl) - now)
  else
    redis.call('HDEL', KEYS[1], all[i])
  end
end
return out
`)

func (b *Bus) lastingKey(topic string) string { return b.prefix + "notes:" + topic }

// recall hands f the lasting notes on topic that still hold.
func (b *Bus) recall(ctx context.Context, topic string, f func(msg string, left time.Duration)) {
	var res []any
	err := b.exec(ctx, func(ctx context.Context) error {
		var err error
		res, err = recallScript.Run(ctx, b.rdb, []string{b.lastingKey(topic)}).Slice()
		return err
	})
	if err != nil {
		b.log.Debug("redis: could not recall the fleet's lasting notes", "topic", topic, "err", err)
		return
	}
	defer b.recoverInput("recall " + topic)
	notes, bad := recalledNotes(res)
	if bad > 0 {
		b.rejected.Add(int64(bad))
		b.log.Debug("redis: ignored unreadable lasting notes", "topic", topic, "count", bad)
	}
	for _, n := range notes {
		f(n.msg, n.left)
	}
}

// recallAll recalls every subscribed topic.
func (b *Bus) recallAll() {
	for t, f := range b.topics.All() {
		b.recall(b.life, t, f)
	}
}

// recalled is one lasting note that still holds.
type recalled struct {
	msg  string
	left time.Duration
}

// recalledNotes reads the recall script's reply: pairs of a message and
// the milliseconds it has left. Pairs that are not that are counted as bad.
func recalledNotes(res []any) (out []recalled, bad int) {
	for i := 0; i+1 < len(res); i += 2 {
		msg, ok1 := res[i].(string)
		ms, ok2 := res[i+1].(int64)
		if !ok1 || !ok2 || ms <= 0 || ms > int64(maxLasting/time.Millisecond) {
			bad++
			continue
		}
		out = append(out, recalled{msg: msg, left: time.Duration(ms) * time.Millisecond})
	}
	if len(res)%2 != 0 {
		bad++
	}
	return out, bad
}

// maxLasting bounds how long a recalled note may claim to hold: anything
// longer was not written by onceproxy.
const maxLasting = 7 * 24 * time.Hour

// sendNotes publishes queued notes until ctx ends.
func (b *Bus) sendNotes(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case n := <-b.out:
			payload := fleetevent.FormatNote(b.instance, n.topic, n.msg)
			err := b.exec(ctx, func(ctx context.Context) error {
				if n.key != "" {
					if err := keepScript.Run(ctx, b.rdb, []string{b.lastingKey(n.topic)},
						n.key, n.ttl.Milliseconds(), n.msg).Err(); err != nil {
						return err
					}
				}
				return b.rdb.Publish(ctx, b.channel, payload).Err()
			})
			if err != nil {
				b.log.Debug("redis: note not published", "err", err)
			}
		}
	}
}

// handleNote delivers "<instance> <topic> <message>" to its topic's
// handler. It reports false for a note it cannot read.
func (b *Bus) handleNote(arg string) bool { return b.topics.Deliver(b.instance, arg) }

// unlockScript deletes a claim only while it is still ours.
var unlockScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
`)

// Claim makes this instance the fleet's only holder of name for ttl (SET
// NX PX). ok is false while another instance holds it; release gives it up
// early. While Redis is away every caller gets ok: a claim that cannot be
// checked must not stop the work it guards.
func (b *Bus) Claim(ctx context.Context, name string, ttl time.Duration) (release func(), ok bool) {
	key := b.prefix + "claim:{" + name + "}"
	token := b.newToken()
	var won bool
	err := b.exec(ctx, func(ctx context.Context) error {
		var err error
		won, err = b.rdb.SetNX(ctx, key, token, ttl).Result()
		return err
	})
	if err != nil {
		return func() {}, true
	}
	if !won {
		return nil, false
	}
	return func() {
		// Not the claimer's context, which may be over; exec bounds it.
		_ = b.exec(context.Background(), func(ctx context.Context) error {
			return unlockScript.Run(ctx, b.rdb, []string{key}, token).Err()
		})
	}, true
}

// takeScript is the rate limiter's step (ratelimit.Counter): the key
// holds the client's time in microseconds by Redis's clock, which every
// instance shares. A value this package did not write (not a number,
// another type, far ahead) counts as a client at rest or, ahead, as one
// whose burst is spent: it never fails the step, nor holds a client back
// for longer than a burst.
// KEYS: the client's key. ARGV: interval, burst (µs). Returns {1 admitted
// or 0, µs ahead of now after the step}.
var takeScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local iv, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local v = redis.pcall('GET', KEYS[1])
local at = type(v) == 'string' and tonumber(v) or nil
if type(v) == 'table' then redis.call('DEL', KEYS[1]) end
if not at or at ~= at or at < now then at = now end
if at > now + burst then at = now + burst end
if at + iv - now > burst then return {0, at - now} end
at = at + iv
redis.call('SET', KEYS[1], string.format('%.0f', at), 'PX', math.ceil((at - now) / 1000) + 1000)
return {1, at - now}
`)

// Take implements ratelimit.Counter fleet-wide: one script per request.
// It fails fast with dedup.ErrUnavailable while the breaker is open.
func (b *Bus) Take(ctx context.Context, key string, interval, burst time.Duration) (time.Duration, bool, error) {
	var res []int64
	err := b.exec(ctx, func(ctx context.Context) error {
		var err error
		res, err = takeScript.Run(ctx, b.rdb, []string{b.prefix + key}, interval.Microseconds(), burst.Microseconds()).Int64Slice()
		return err
	})
	if err != nil {
		return 0, false, err
	}
	if len(res) != 2 {
		return 0, false, fmt.Errorf("redis: rate limiter step: %d values, want 2", len(res))
	}
	return time.Duration(res[1]) * time.Microsecond, res[0] == 1, nil
}

// bindScript returns the session a sticky key is bound to, binding it to
// the proposal (ARGV[1]) when it is bound to none, and keeps the binding
// for ARGV[2] ms either way: one round trip, atomic, so racing instances
// agree on the first proposal.
var bindScript = redis.NewScript(`
local cur = redis.call('GET', KEYS[1])
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return cur
`)

// rebindScript moves a sticky key from ARGV[1] to ARGV[2] (or binds it
// when it is bound to none) and returns the session it is bound to then:
// ARGV[2], or the one another instance moved it to first.
var rebindScript = redis.NewScript(`
local cur = redis.call('GET', KEYS[1])
if (not cur) or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return ARGV[2]
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return cur
`)

// Bind returns the session the fleet bound key to, binding it to proposal
// first when it is bound to none (upstream.Bindings): one round trip. It
// fails fast with dedup.ErrUnavailable while the breaker is open.
func (b *Bus) Bind(ctx context.Context, key, proposal string, ttl time.Duration) (string, error) {
	return b.runBinding(ctx, bindScript, key, proposal, ttl.Milliseconds())
}

// Rebind moves key from `from` to `to` unless another instance moved it
// first, and returns the session it is bound to now (upstream.Bindings):
// one round trip.
func (b *Bus) Rebind(ctx context.Context, key, from, to string, ttl time.Duration) (string, error) {
	return b.runBinding(ctx, rebindScript, key, from, to, ttl.Milliseconds())
}

func (b *Bus) runBinding(ctx context.Context, script *redis.Script, key string, args ...any) (string, error) {
	var id string
	err := b.exec(ctx, func(ctx context.Context) error {
		var err error
		id, err = script.Run(ctx, b.rdb, []string{b.prefix + key}, args...).Text()
		return err
	})
	return id, err
}
