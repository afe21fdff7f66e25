package rediscache

import (
	"context"
	"strconv"
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

// noteQueue bounds the notes waiting to be published: a burst (every
// session failing at once) never blocks a request or grows without bound.
const noteQueue = 256

type notes struct {
	mu       sync.RWMutex
	handlers map[string]func(msg string)
	out      chan string
}

// Publish sends msg on topic to the other instances. It never blocks: with
// the queue full (Redis slow or away) the note is dropped.
func (s *Store) Publish(topic, msg string) {
	select {
	case s.notes.out <- "n " + s.instance + " " + topic + " " + msg:
	default:
		s.log.Debug("redis: note dropped, queue full", "topic", topic)
	}
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
		case payload := <-s.notes.out:
			err := s.exec(ctx, func(ctx context.Context) error {
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
	token := s.instance + "-" + strconv.FormatUint(s.seq.Add(1), 36)
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
		ctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
		defer cancel()
		_ = s.exec(ctx, func(ctx context.Context) error {
			return unlockScript.Run(ctx, s.rdb, []string{key}, token).Err()
		})
	}, true
}
