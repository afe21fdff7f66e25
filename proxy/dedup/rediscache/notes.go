package rediscache

import (
	"context"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Notes are small messages between the instances of a fleet for other
// parts of the proxy (upstream session news: a cooldown, a rotation). They
// ride the events channel the flights already use, as
// "n <instance> <topic> <message>"; an instance ignores its own. Delivery is
// best effort, like everything on a Redis channel: a note lost while Redis
// is away costs the fleet what it would cost without Redis.
//
// A lasting note (a cooldown: true for a while) is also kept in Redis until
// it expires, so that an instance that starts later, or comes back after
// losing Redis, can recall what the fleet knows.

// noteQueue bounds the notes waiting to be published: a burst (every
// session failing at once) never blocks a request or grows without bound.
const noteQueue = 256

type notes struct {
	mu       sync.RWMutex
	handlers map[string]func(msg string)
	onBack   []func()
	out      chan note
}

// OnReconnect registers f to run (on a goroutine of its own) each time
// Redis comes back after the breaker opened: notes sent meanwhile were
// lost, and a Recall catches up on the lasting ones.
func (s *Store) OnReconnect(f func()) {
	s.notes.mu.Lock()
	defer s.notes.mu.Unlock()
	s.notes.onBack = append(s.notes.onBack, f)
}

// reconnected runs the OnReconnect functions. It is called from the
// breaker's state change, under the breaker's lock, where a Redis call
// would deadlock: hence goroutines, which Close waits for.
func (s *Store) reconnected() {
	s.notes.mu.RLock()
	defer s.notes.mu.RUnlock()
	for _, f := range s.notes.onBack {
		s.bg.Add(1)
		go func() {
			defer s.bg.Done()
			f()
		}()
	}
}

// note is one note on its way out.
type note struct {
	topic, msg string
	key        string        // lasting notes: what it is about (one kept per key)
	ttl        time.Duration // lasting notes: how long it holds
}

// Publish sends msg on topic to the other instances. It never blocks: with
// the queue full (Redis slow or away) the note is dropped.
func (s *Store) Publish(topic, msg string) {
	s.enqueue(note{topic: topic, msg: msg})
}

// PublishLasting publishes msg and keeps it for ttl under key (a later
// note on the same key replaces it unless it would expire sooner), for
// Recall. Never blocks, like Publish.
func (s *Store) PublishLasting(topic, key, msg string, ttl time.Duration) {
	s.enqueue(note{topic: topic, msg: msg, key: key, ttl: ttl})
}

func (s *Store) enqueue(n note) {
	select {
	case s.notes.out <- n:
	default:
		s.log.Debug("redis: note dropped, queue full", "topic", n.topic)
	}
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

func (s *Store) lastingKey(topic string) string { return s.prefix + "notes:" + topic }

// Recalled is a lasting note that still holds.
type Recalled struct {
	Msg  string
	Left time.Duration
}

// Recall returns the lasting notes on topic that still hold.
func (s *Store) Recall(ctx context.Context, topic string) ([]Recalled, error) {
	var res []any
	err := s.exec(ctx, func(ctx context.Context) error {
		var err error
		res, err = recallScript.Run(ctx, s.rdb, []string{s.lastingKey(topic)}).Slice()
		return err
	})
	if err != nil {
		return nil, err
	}
	var out []Recalled
	for i := 0; i+1 < len(res); i += 2 {
		msg, _ := res[i].(string)
		ms, _ := res[i+1].(int64)
		out = append(out, Recalled{Msg: msg, Left: time.Duration(ms) * time.Millisecond})
	}
	return out, nil
}

// Subscribe makes f receive the notes other instances publish on topic, on
// the events goroutine (f must be quick). One handler per topic.
func (s *Store) Subscribe(topic string, f func(msg string)) {
	s.notes.mu.Lock()
	defer s.notes.mu.Unlock()
	s.notes.handlers[topic] = f
}

// sendNotes publishes queued notes until ctx ends.
func (s *Store) sendNotes(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case n := <-s.notes.out:
			payload := "n " + s.instance + " " + n.topic + " " + n.msg
			err := s.exec(ctx, func(ctx context.Context) error {
				if n.key != "" {
					if err := keepScript.Run(ctx, s.rdb, []string{s.lastingKey(n.topic)},
						n.key, n.ttl.Milliseconds(), n.msg).Err(); err != nil {
						return err
					}
				}
				return s.rdb.Publish(ctx, s.channel, payload).Err()
			})
			if err != nil {
				s.log.Debug("redis: note not published", "err", err)
			}
		}
	}
}

// handleNote delivers "<instance> <topic> <message>" to its topic's handler.
func (s *Store) handleNote(arg string) {
	from, rest, ok := strings.Cut(arg, " ")
	if !ok || from == s.instance {
		return
	}
	topic, msg, ok := strings.Cut(rest, " ")
	if !ok {
		return
	}
	s.notes.mu.RLock()
	f := s.notes.handlers[topic]
	s.notes.mu.RUnlock()
	if f != nil {
		f(msg)
	}
}

// unlockScript deletes a claim only while it is still ours.
var unlockScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
`)

// Claim makes this instance the fleet's only holder of name for ttl (SET
// NX PX). ok is false while another instance holds it; release gives it up
// early. While Redis is away every caller gets ok: a claim that cannot be
// checked must not stop the work it guards.
func (s *Store) Claim(ctx context.Context, name string, ttl time.Duration) (release func(), ok bool) {
	key := s.prefix + "claim:{" + name + "}"
	token := s.newToken()
	var won bool
	err := s.exec(ctx, func(ctx context.Context) error {
		var err error
		won, err = s.rdb.SetNX(ctx, key, token, ttl).Result()
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
		_ = s.exec(context.Background(), func(ctx context.Context) error {
			return unlockScript.Run(ctx, s.rdb, []string{key}, token).Err()
		})
	}, true
}
