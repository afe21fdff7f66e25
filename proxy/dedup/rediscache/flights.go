package rediscache

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// acquireScript is the fleet flight's state machine, one atomic step:
//
//	value stored        → {2, value}    read it (the re-check after winning locally)
//	waiting, outcome    → {3, outcome}  the flight we waited on ended
//	lock held           → {0, token}    someone leads: wait
//	otherwise           → take the lock, drop a stale outcome → {1}
//
// A caller that has not waited yet ignores an old outcome: a new request
// may retry a failed flight. A waiter whose leader vanished (the lock
// expired without a value or an outcome) takes the lock over.
var acquireScript = redis.NewScript(`
local v = redis.call('GET', KEYS[2])
if v then return {2, v} end
if ARGV[3] == '1' then
  local o = redis.call('GET', KEYS[3])
  if o then return {3, o} end
end
local l = redis.call('GET', KEYS[1])
if l then return {0, l} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('DEL', KEYS[3])
return {1}
`)

// finishScript stores the value (or the short-lived outcome for waiters),
// releases our own lock only, and wakes every process's waiters.
var finishScript = redis.NewScript(`
if ARGV[2] ~= '' then redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3]) end
if ARGV[4] ~= '' then redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[5]) end
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
redis.call('PUBLISH', ARGV[6], ARGV[7])
return 1
`)

// renewScript extends our own lock.
var renewScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
`)

// releaseScript drops our own lock without an outcome and wakes waiters so
// one of them takes over at once instead of at lease expiry.
var releaseScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
`)

// Join implements dedup.Fleet.
func (s *Cache) Join(ctx context.Context, key string) (dedup.Lease, *dedup.Outcome, error) {
	if !s.available() {
		return nil, nil, dedup.ErrUnavailable
	}
	tag := tagOf(key)
	// Register before the first check: a completion published between the
	// check and the wait must still wake us.
	wake := s.waiters.add(tag)
	defer s.waiters.remove(tag, wake)
	token := s.newToken()
	keys := []string{s.lockKey(tag), s.valueKey(tag), s.outcomeKey(tag)}
	lease := strconv.FormatInt(s.cfg.Lease.Milliseconds(), 10)
	var poll *time.Ticker
	waiting := "0"
	for {
		var res []any
		err := s.exec(ctx, func(ctx context.Context) error {
			var err error
			res, err = acquireScript.Run(ctx, s.rdb, keys, token, lease, waiting).Slice()
			return err
		})
		if err != nil {
			return nil, nil, err
		}
		switch kind, _ := res[0].(int64); kind {
		case 1:
			return s.newLease(tag, token), nil, nil
		case 2:
			e, err := decode([]byte(stringAt(res, 1)))
			if err == nil && time.Now().Before(e.ExpiresAt) {
				s.putLocal(key, e)
				// Found at once it is a cache hit; found after waiting,
				// it is the result of the flight we waited on.
				return nil, &dedup.Outcome{Entry: e, Cached: waiting == "0"}, nil
			}
			// A value we cannot read (an older format) is in the way:
			// remove it and run the flight.
			_ = s.exec(ctx, func(ctx context.Context) error { return s.rdb.Del(ctx, keys[1]).Err() })
			continue
		case 3:
			out, err := decodeOutcome([]byte(stringAt(res, 1)))
			if err == nil {
				return nil, out, nil
			}
			_ = s.exec(ctx, func(ctx context.Context) error { return s.rdb.Del(ctx, keys[2]).Err() })
			continue
		}
		// Someone else leads: wait for the completion message, with
		// polling as the safety net for a lost message or a dead leader.
		waiting = "1"
		if poll == nil {
			poll = time.NewTicker(s.cfg.PollInterval)
			defer poll.Stop()
			s.fleetWaits.Add(1)
			defer s.fleetWaits.Add(-1)
		}
		select {
		case <-wake:
		case <-poll.C:
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		case <-s.life.Done():
			return nil, nil, dedup.ErrUnavailable
		}
	}
}

func stringAt(res []any, i int) string {
	if i < len(res) {
		if s, ok := res[i].(string); ok {
			return s
		}
	}
	return ""
}

// lease is one fleet flight this process leads. It renews its lock until
// Finish or Release.
type lease struct {
	s     *Cache
	tag   string
	token string
	stop  context.CancelFunc
	once  sync.Once
}

func (s *Cache) newLease(tag, token string) *lease {
	ctx, stop := context.WithCancel(s.life)
	l := &lease{s: s, tag: tag, token: token, stop: stop}
	s.leases.Add(1)
	go l.renew(ctx)
	return l
}

// renew keeps the lock while the fetch runs: a leader that crashes stops
// renewing, and its waiters take over within one lease.
func (l *lease) renew(ctx context.Context) {
	defer l.s.leases.Done()
	t := time.NewTicker(l.s.cfg.Lease / 3)
	defer t.Stop()
	ms := strconv.FormatInt(l.s.cfg.Lease.Milliseconds(), 10)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			_ = l.s.exec(ctx, func(ctx context.Context) error {
				return renewScript.Run(ctx, l.s.rdb, []string{l.s.lockKey(l.tag)}, l.token, ms).Err()
			})
		}
	}
}

// Finish implements dedup.Lease.
func (l *lease) Finish(ctx context.Context, out dedup.Outcome, ttl time.Duration) error {
	var err error
	l.once.Do(func() {
		l.stop()
		err = l.s.finish(ctx, l, out, ttl)
	})
	return err
}

// Release implements dedup.Lease.
func (l *lease) Release() {
	l.once.Do(func() {
		l.stop()
		ctx, cancel := context.WithTimeout(context.Background(), l.s.cfg.Timeout)
		defer cancel()
		_ = l.s.exec(ctx, func(ctx context.Context) error {
			return releaseScript.Run(ctx, l.s.rdb, []string{l.s.lockKey(l.tag)}, l.token, l.s.channel, "d "+l.tag).Err()
		})
	})
}

func (s *Cache) finish(ctx context.Context, l *lease, out dedup.Outcome, ttl time.Duration) error {
	var value, outcome []byte
	if out.Entry != nil && ttl > 0 {
		s.putLocal(fullKey(l.tag), out.Entry)
		value = encode(out.Entry)
		if int64(len(value)) > int64(s.cfg.MaxValueBytes) {
			// Too big to share as a cached value; the waiters still
			// need it, once.
			value = nil
		}
	}
	if value == nil {
		outcome = encodeOutcome(out)
		if int64(len(outcome)) > int64(s.cfg.MaxValueBytes) {
			outcome = encodeOutcome(dedup.Outcome{Err: "response too large to share across instances"})
		}
	}
	keys := []string{s.lockKey(l.tag), s.valueKey(l.tag), s.outcomeKey(l.tag)}
	err := s.exec(ctx, func(ctx context.Context) error {
		return finishScript.Run(ctx, s.rdb, keys, l.token,
			value, ttl.Milliseconds(), outcome, s.cfg.FailureTTL.Milliseconds(),
			s.channel, "d "+l.tag).Err()
	})
	if err != nil || value == nil || out.Entry.URLKey == "" {
		return err
	}
	// The URL index lives in another slot: not part of the script.
	return s.exec(ctx, func(ctx context.Context) error {
		_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			s.index(ctx, p, out.Entry.URLKey, fullKey(l.tag), ttl)
			return nil
		})
		return err
	})
}

// The outcome value: a kind byte, then an encoded entry or a message.
const (
	outcomeEntry   = 'E'
	outcomeError   = 'X'
	outcomeTimeout = 'T'
)

func encodeOutcome(out dedup.Outcome) []byte {
	switch {
	case out.Entry != nil:
		return append([]byte{outcomeEntry}, encode(out.Entry)...)
	case out.Timeout:
		return append([]byte{outcomeTimeout}, out.Err...)
	default:
		return append([]byte{outcomeError}, out.Err...)
	}
}

func decodeOutcome(b []byte) (*dedup.Outcome, error) {
	if len(b) == 0 {
		return nil, errFormat
	}
	switch b[0] {
	case outcomeEntry:
		e, err := decode(b[1:])
		if err != nil {
			return nil, err
		}
		return &dedup.Outcome{Entry: e}, nil
	case outcomeError, outcomeTimeout:
		return &dedup.Outcome{Err: string(b[1:]), Timeout: b[0] == outcomeTimeout}, nil
	}
	return nil, fmt.Errorf("%w: outcome kind %q", errFormat, b[0])
}

// waiterSet maps a key's tag to the local waiters to wake when a flight
// for it ends anywhere in the fleet.
type waiterSet struct {
	mu sync.Mutex
	m  map[string]map[chan struct{}]struct{}
}

func (w *waiterSet) add(tag string) chan struct{} {
	ch := make(chan struct{}, 1)
	w.mu.Lock()
	set := w.m[tag]
	if set == nil {
		set = make(map[chan struct{}]struct{})
		w.m[tag] = set
	}
	set[ch] = struct{}{}
	w.mu.Unlock()
	return ch
}

func (w *waiterSet) remove(tag string, ch chan struct{}) {
	w.mu.Lock()
	delete(w.m[tag], ch)
	if len(w.m[tag]) == 0 {
		delete(w.m, tag)
	}
	w.mu.Unlock()
}

func (w *waiterSet) wake(tag string) {
	w.mu.Lock()
	for ch := range w.m[tag] {
		select {
		case ch <- struct{}{}:
		default: // already has a pending wake-up
		}
	}
	w.mu.Unlock()
}
