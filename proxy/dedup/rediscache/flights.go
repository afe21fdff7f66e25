package rediscache

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/fleetevent"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/storecodec"
)

// joinScript is a fleet flight's state machine, one atomic step, and the
// only round trip a request needs before it knows what to do:
//
//	value stored            → {2}                    a hit, or the result waited for
//	waited, outcome stored  → {3, outcome, holder}   the flight waited on ended without a value
//	lock free               → take it, drop a stale outcome → {1}: lead
//	lock held               → flag the flight as waited on → {0, holder, outcome}: wait
//
// KEYS: lock, value, outcome, waiters. ARGV: token, lease (ms), "1" once
// the caller has waited, and a holder found gone (or "").
//
// The value itself is read by a plain GET just before the script, in the
// same round trip: a value passed through Lua is copied and interned twice
// over, which costs Redis several times what the GET does.
//
// A caller that has not waited yet ignores an old outcome: a new request
// may retry a failed flight. A waiter takes the lock over when the lease
// has lapsed, or at once when it names the holder as gone (its presence
// key lapsed) and the lock is still that holder's. A lock without an
// expiry (not one of ours: something else wrote it) gets the lease, so
// that it lapses like ours instead of holding its key for ever. The
// waiters flag tells
// the leader that someone elsewhere waits: only then does the end of the
// flight cost a message to every instance (and, without a value, an
// outcome kept in Redis).
//
// The holder, the lock's value, names the leader's peer listener when it
// has one (see leaseToken). A leader streaming a body too big for Redis
// keeps its lock and an outcome saying so (see streamScript): a new
// request sees both at once and reads the body from the leader instead of
// waiting for a download that will not come through Redis. While a lock
// is held every outcome there is its holder's: taking the lock drops the
// one before.
var joinScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[2]) == 1 then return {2} end
if ARGV[3] == '1' then
  local o = redis.call('GET', KEYS[3])
  if o then return {3, o, redis.call('GET', KEYS[1])} end
end
if ARGV[4] ~= '' and redis.call('GET', KEYS[1]) == ARGV[4] then redis.call('DEL', KEYS[1]) end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('DEL', KEYS[3])
  return {1}
end
if redis.call('PTTL', KEYS[1]) == -1 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
redis.call('SET', KEYS[4], '1', 'PX', ARGV[2])
return {0, redis.call('GET', KEYS[1]), redis.call('GET', KEYS[3])}
`)

// finishScript ends a flight without a value (storedScript ends the
// others): it releases our own lock and, when someone waits elsewhere,
// keeps the outcome for them and wakes every process's waiters. It returns
// 0 (nobody waited, or the flight is another's now), 1 (waiters woken) or
// 2: there are waiters and the outcome was too big to send before knowing
// that (ARGV[6]), so the lock is kept and the caller runs the script again
// with the outcome.
//
// A lock that another instance holds (ours lapsed, and it took the flight
// over) leaves everything as it is: the outcome and the waiters flag are
// its flight's now, and ours must not stand in for its answer.
//
// KEYS: lock, value, outcome, waiters. ARGV: token, outcome or "", outcome
// TTL (ms), channel, message, "1" when the outcome follows.
var finishScript = redis.NewScript(`
local lock = redis.call('GET', KEYS[1])
if lock and lock ~= ARGV[1] then return 0 end
local waited = redis.call('EXISTS', KEYS[4]) == 1
if waited and ARGV[6] == '1' then return 2 end
if lock then redis.call('DEL', KEYS[1]) end
if not waited then return 0 end
redis.call('DEL', KEYS[4])
if ARGV[2] ~= '' then redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3]) end
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
`)

// storedScript ends a flight whose value a plain SET just before it in
// the same round trip has stored: it drops the lock and, when someone
// elsewhere waited, the waiters flag, and wakes every process's waiters.
// It returns 1 when it woke them.
//
// Unlike the other scripts it does not ask whose the lock is: the value is
// there first, so whoever looks from now on finds it and takes no lock. A
// lock that is not ours (our lease lapsed and another instance took the
// flight over) is for the same value: its holder's waiters find ours, and
// its own finish overwrites it. Asking would cost Redis a GET per miss.
//
// KEYS: lock, waiters. ARGV: channel, message.
var storedScript = redis.NewScript(`
redis.call('DEL', KEYS[1])
if redis.call('DEL', KEYS[2]) == 0 then return 0 end
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
`)

// renewScript extends our own lock, and the outcome a streaming lease
// keeps beside it (ARGV[3] "1").
// KEYS: lock, outcome. ARGV: token, lease (ms), "1" when streaming.
var renewScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if ARGV[3] == '1' then redis.call('PEXPIRE', KEYS[2], ARGV[2]) end
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
`)

// streamScript keeps our lock and stores, for as long as it, the outcome
// that sends the flight's waiters to our peer listener for a body too big
// for Redis; those already waiting are woken. 0: the lock is not ours any
// more.
// KEYS: lock, value, outcome, waiters. ARGV: token, outcome, lease (ms),
// channel, message.
var streamScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3])
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('DEL', KEYS[4])
  redis.call('PUBLISH', ARGV[4], ARGV[5])
end
return 1
`)

// releaseScript drops our own lock without an outcome and wakes the
// waiters, if any, so one of them takes over at once.
// KEYS: lock, value, outcome, waiters. ARGV: token, channel, message.
var releaseScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('PUBLISH', ARGV[2], ARGV[3]) end
return 1
`)

const (
	// inlineOutcomeBytes is the largest outcome sent with the end of a
	// flight whether or not anyone waits for it; a bigger one is sent
	// only to a flight that has waiters, at the cost of a second trip.
	inlineOutcomeBytes = 64 << 10
	// maxOutcomeBytes bounds an outcome (far below Redis's 512 MB
	// proto-max-bulk-len; dedup.max_body_bytes, 8 MiB by default, bounds
	// it first): beyond it, the waiters elsewhere get an error.
	maxOutcomeBytes = 64 << 20
	// maxLooks bounds the looks at a flight in a row without waiting in
	// between (an unreadable value removed, a holder found gone).
	maxLooks = 4
)

// Join implements dedup.Fleet. A request costs one round trip before it
// knows whether it has a value, leads, or waits; a waiter checks, with
// each later look, whether its leader is still present.
func (s *Cache) Join(ctx context.Context, key string) (dedup.Lease, *dedup.Outcome, error) {
	if !s.available() {
		return s.alone(key)
	}
	tag := tagOf(key)
	// Marked before the first look, registered once we wait: a message
	// between the look and the wait still wakes us, and a request that
	// leads or finds the value registers nothing.
	mark := s.waiters.Mark(tag)
	var wake chan struct{}
	token := s.leaseToken()
	keys := s.flightKeys(tag)
	var (
		registered bool // with the waiters, for messages and the instance's poll
		waited     bool
		holder     string // the lock's holder as last seen, if it keeps a presence key
		seen       string // the lock's holder as last seen
		gone       string // a holder found gone: take its lock over
		again      int    // looks in a row without waiting
	)
	for {
		// A value or outcome that keeps coming back unreadable (written
		// by something else) must not keep this loop busy.
		if again++; again > maxLooks {
			return nil, nil, fmt.Errorf("rediscache: %s keeps answering what cannot be used; fetching without the fleet", key)
		}
		res, value, present, err := s.joinStep(ctx, keys, token, waited, holder, gone)
		if errors.Is(err, errWrongType) {
			// Something else wrote one of the flight's keys: remove it
			// and look again.
			s.dropForeign(ctx, keys...)
			continue
		}
		if errors.Is(err, dedup.ErrUnavailable) {
			return s.alone(key)
		}
		if err != nil {
			return nil, nil, err
		}
		gone = ""
		switch kind, _ := res[0].(int64); kind {
		case 1:
			l := s.newLease(key, tag, token, keys)
			if e := s.givenBack(key); e != nil {
				// The fleet lost this copy, or never had it: give it
				// back instead of fetching it again.
				_ = l.Finish(ctx, dedup.Outcome{Entry: e}, time.Until(e.ExpiresAt))
				return nil, &dedup.Outcome{Entry: e, Cached: true}, nil
			}
			return l, nil, nil
		case 2:
			if value == nil {
				continue // stored between the GET and the script: look again
			}
			if e, ok := s.decodeValue(key, value); ok {
				s.keepShared(key, e)
				// Found at once it is a cache hit; found after waiting,
				// it is the result of the flight we waited on.
				return nil, &dedup.Outcome{Entry: e, Cached: !waited}, nil
			}
			// A value we cannot read (another version's), or expired by
			// this process's clock, is in the way: remove it and run the
			// flight.
			_ = s.exec(ctx, func(ctx context.Context) error { return s.rdb.Del(ctx, keys[1]).Err() })
			continue
		case 3:
			out, err := storecodec.DecodeOutcome([]byte(stringAt(res, 1)), s.maxBody())
			if err == nil {
				if out.IsTooLarge() {
					// The leader still streaming it, or the one we
					// waited on, which may hold it in its cache.
					if out.Peer = s.peerOf(stringAt(res, 2)); out.Peer == nil {
						out.Peer = s.peerOf(seen)
					}
				}
				return nil, out, nil
			}
			_ = s.exec(ctx, func(ctx context.Context) error { return s.rdb.Del(ctx, keys[2]).Err() })
			continue
		}
		// Someone else leads. Gone (its presence lapsed while it still
		// holds the lock): take over now, not when the lease lapses.
		h := stringAt(res, 1)
		seen = h
		if out := s.streaming(h, stringAt(res, 2)); out != nil {
			return nil, out, nil
		}
		if holder != "" && h == holder && !present {
			s.log.Info("redis: a flight's leader is gone; taking it over", "leader", h)
			gone = h
			continue
		}
		holder = ""
		if _, ok := holderOf(h); ok {
			holder = h
		}
		// Wait for the completion message, with the instance's poll
		// (pollWaits) as the safety net for a lost message or a dead
		// leader.
		waited, again = true, 0
		if !registered {
			registered = true
			wake = s.waiters.Add(tag, mark)
			defer s.waiters.Remove(tag, wake)
			s.fleetWaits.Add(1)
			defer s.fleetWaits.Add(-1)
		}
		select {
		case <-wake:
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		case <-s.life.Done():
			return nil, nil, dedup.ErrUnavailable
		}
	}
}

// pollWaits is the waiters' safety net (fleetevent.Waiters.Poll): one
// pipeline per poll_interval finds the flights this instance waits on
// that ended (a completion message lost), lost their lock (its lease
// lapsed) or their leader (its presence key lapsed). It also keeps each
// flight's waiters flag alive, so that the leader's end still sends the
// message however long the flight takes (the join script a waiter ran at
// every poll used to), every third of the lease (see flagsKept).
func (s *Cache) pollWaits(ctx context.Context) {
	kept := flagsKept{every: s.cfg.Lease / 3, at: map[string]time.Time{}}
	s.waiters.Poll(ctx, s.cfg.PollInterval, func(ctx context.Context, tags []string) ([]string, error) {
		return s.flightsToLook(ctx, tags, kept.due(tags, time.Now()))
	})
}

// flagsKept schedules the poll's renewals of the waiters flags, for the
// one goroutine that polls. A flag lives for the lease from its last
// renewal, so renewing it every third of the lease keeps it with two
// thirds to spare; once a poll (100ms against the 5s lease, as shipped),
// it was a third of every poll's commands, for flags nowhere near their
// end.
type flagsKept struct {
	every  time.Duration
	at     map[string]time.Time // when the poll last renewed each tag's flag
	pruned time.Time
}

// due reports, for each of tags, whether its flag is due a renewal now,
// and counts the renewals as done: a poll that fails wakes every waiter,
// whose own look sets the flag again.
func (k *flagsKept) due(tags []string, now time.Time) []bool {
	if now.Sub(k.pruned) >= k.every {
		// A flight still waited on is renewed every k.every: one older
		// than twice that is waited on no more.
		k.pruned = now
		for tag, t := range k.at {
			if now.Sub(t) > 2*k.every {
				delete(k.at, tag)
			}
		}
	}
	due := make([]bool, len(tags))
	for i, tag := range tags {
		if t, ok := k.at[tag]; !ok || now.Sub(t) >= k.every {
			k.at[tag] = now
			due[i] = true
		}
	}
	return due
}

// flightsToLook returns those of tags whose flight needs a look: its
// value or outcome is there, its lock is not, or the lock's holder is
// gone. It renews the waiters flag of the tags renew marks.
func (s *Cache) flightsToLook(ctx context.Context, tags []string, renew []bool) (ready []string, err error) {
	err = s.exec(ctx, func(ctx context.Context) error {
		ended := make([]*redis.IntCmd, len(tags))
		locks := make([]*redis.StringCmd, len(tags))
		_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, tag := range tags {
				keys := s.flightKeys(tag)
				ended[i] = p.Exists(ctx, keys[1], keys[2]) // one slot: the tag's
				locks[i] = p.Get(ctx, keys[0])
				if renew[i] {
					p.PExpire(ctx, keys[3], s.cfg.Lease)
				}
			}
			return nil
		})
		if err != nil && !errors.Is(err, redis.Nil) {
			return err
		}
		holders := map[string][]string{} // a holder with a presence key → its flights
		for i, tag := range tags {
			lock, err := locks[i].Result()
			switch {
			case errors.Is(err, redis.Nil) || ended[i].Val() > 0:
				ready = append(ready, tag)
			case err != nil:
				return err
			default:
				if instance, ok := holderOf(lock); ok {
					holders[instance] = append(holders[instance], tag)
				}
			}
		}
		if len(holders) == 0 {
			return nil
		}
		present := make(map[string]*redis.IntCmd, len(holders))
		if _, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for instance := range holders {
				present[instance] = p.Exists(ctx, s.presenceKey(instance))
			}
			return nil
		}); err != nil {
			return err
		}
		for instance, flights := range holders {
			if present[instance].Val() == 0 {
				ready = append(ready, flights...)
			}
		}
		return nil
	})
	return ready, err
}

// joinStep runs the join script once, after a GET of the value in the same
// round trip. With holder set (a waiter that knows who leads), it also asks
// whether the holder's presence key is still there; present is true
// otherwise.
func (s *Cache) joinStep(ctx context.Context, keys []string, token string, waited bool, holder, gone string) (res []any, value []byte, present bool, err error) {
	args := []any{token, s.cfg.Lease.Milliseconds(), "0", gone}
	if waited {
		args[2] = "1"
	}
	present = true
	err = s.execBatched(ctx, func(ctx context.Context) error {
		var get *redis.StringCmd
		var alive *redis.IntCmd
		instance, checkHolder := holderOf(holder)
		cmd, err := s.evalWith(ctx, joinScript, keys, args,
			func(p redis.Pipeliner) { get = p.Get(ctx, keys[1]) },
			func(p redis.Pipeliner) {
				if checkHolder {
					alive = p.Exists(ctx, s.presenceKey(instance))
				}
			})
		if err != nil {
			return err
		}
		if alive != nil {
			present = alive.Val() == 1
		}
		if b, err := get.Bytes(); err == nil {
			value = b
		}
		res, err = cmd.Slice()
		if err == nil && len(res) == 0 {
			err = fmt.Errorf("%w: empty reply", storecodec.ErrFormat)
		}
		return err
	})
	return res, value, present, err
}

// evalWith runs script in one pipeline, after the commands before queues
// and before those after queues (either may be nil), and returns the
// script's command once every command has an answer. The pipeline goes in
// the batcher's next round trip, with other requests' steps.
func (c *client) evalWith(ctx context.Context, script *redis.Script, keys []string, args []any, before, after func(redis.Pipeliner)) (*redis.Cmd, error) {
	var cmd *redis.Cmd
	err := byHash(func(whole bool) error {
		cmds, err := c.batch.do(ctx, func(p redis.Pipeliner) {
			if before != nil {
				before(p)
			}
			cmd = eval(ctx, p, script, whole, keys, args...)
			if after != nil {
				after(p)
			}
		})
		if err != nil {
			return err
		}
		// A GET of a missing key answers redis.Nil: an answer, not a
		// failure.
		for _, c := range cmds {
			if err := c.Err(); err != nil && !errors.Is(err, redis.Nil) && c != cmd {
				return err
			}
		}
		return cmd.Err()
	})
	if err != nil {
		// cmd may still be the flusher's: a step whose caller gave up
		// goes out without it.
		return nil, err
	}
	return cmd, nil
}

// byHash runs send with its scripts sent by their hash and, when Redis
// does not have one (restarted, flushed), once more with them sent whole.
func byHash(send func(whole bool) error) error {
	err := send(false)
	// HasErrorPrefix allocates, even for no error at all.
	if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		err = send(true)
	}
	return err
}

// eval queues script on p, whole or by its hash.
func eval(ctx context.Context, p redis.Pipeliner, script *redis.Script, whole bool, keys []string, args ...any) *redis.Cmd {
	if whole {
		return script.Eval(ctx, p, keys, args...)
	}
	return script.EvalSha(ctx, p, keys, args...)
}

// alone answers a Join without Redis: this process's copy, if it has one,
// is the cache; otherwise the caller fetches on its own.
func (s *Cache) alone(key string) (dedup.Lease, *dedup.Outcome, error) {
	if e, err := s.local.Get(context.Background(), key); err == nil {
		return nil, &dedup.Outcome{Entry: e, Cached: true}, nil
	}
	return nil, nil, dedup.ErrUnavailable
}

func stringAt(res []any, i int) string {
	if i < len(res) {
		if s, ok := res[i].(string); ok {
			return s
		}
	}
	return ""
}

// lease is one fleet flight this process leads. Its lock is renewed by
// the Cache's renewer (see renewLeases) until Finish or Release.
type lease struct {
	s     *Cache
	key   string // the flight's key, as Join was given it
	tag   string
	token string
	keys  []string // flightKeys(tag)
	once  sync.Once
	// streamed: the waiters read the body from our peer listener; the
	// renewals keep the outcome that says so beside the lock.
	streamed atomic.Bool
}

func (s *Cache) newLease(key, tag, token string, keys []string) *lease {
	l := &lease{s: s, key: key, tag: tag, token: token, keys: keys}
	s.held.Lock()
	s.held.m[l] = time.Now()
	s.held.Unlock()
	return l
}

// stop ends l's renewals.
func (l *lease) stop() {
	l.s.held.Lock()
	delete(l.s.held.m, l)
	l.s.held.Unlock()
}

// heldLeases are the leases this process holds, each with when its lock
// was taken or last renewed.
type heldLeases struct {
	sync.Mutex
	m map[*lease]time.Time
}

// renewLeases keeps the locks of the flights this process leads while
// their fetches run: every sixth of a lease it renews, in one pipeline,
// those taken or renewed a third of a lease ago or more, so a lock is
// renewed well before it lapses (at most half a lease after the last
// time). A leader whose process is gone stops renewing, and its waiters
// take over within one lease (sooner when its presence key lapses first).
// One goroutine for them all: a lease costs a map entry, not a goroutine,
// a ticker and a context of its own, and most flights end long before
// their first renewal.
func (s *Cache) renewLeases() {
	defer s.leases.Done()
	if s.cfg.Lease <= 0 {
		return // an unset lease (Validate refuses it): nothing can be renewed
	}
	t := time.NewTicker(s.cfg.Lease / 6)
	defer t.Stop()
	for {
		select {
		case <-s.life.Done():
			return
		case now := <-t.C:
			if due := s.dueLeases(now); len(due) > 0 {
				s.renew(due, now)
			}
		}
	}
}

// dueLeases returns the held leases last renewed a third of a lease ago
// or more.
func (s *Cache) dueLeases(now time.Time) []*lease {
	s.held.Lock()
	defer s.held.Unlock()
	var due []*lease
	for l, at := range s.held.m {
		if now.Sub(at) >= s.cfg.Lease/3 {
			due = append(due, l)
		}
	}
	return due
}

// renew extends due's locks (and a streaming lease's outcome) in one
// pipeline, the script by its hash, or whole when Redis does not have it
// (restarted, flushed). A lock that is not ours any more is left alone by
// the script. On failure the next tick tries again, within the lease.
func (s *Cache) renew(due []*lease, now time.Time) {
	ms := strconv.FormatInt(s.cfg.Lease.Milliseconds(), 10)
	err := s.exec(s.life, func(ctx context.Context) error {
		return byHash(func(whole bool) error {
			_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
				for _, l := range due {
					streamed := "0"
					if l.streamed.Load() {
						streamed = "1"
					}
					eval(ctx, p, renewScript, whole, []string{s.lockKey(l.tag), s.outcomeKey(l.tag)}, l.token, ms, streamed)
				}
				return nil
			})
			return err
		})
	})
	if err != nil {
		return
	}
	s.held.Lock()
	defer s.held.Unlock()
	for _, l := range due {
		if _, ok := s.held.m[l]; ok {
			s.held.m[l] = now
		}
	}
}

// StreamAbove implements dedup.StreamingLease: bodies bigger than a
// Redis value may be are read from this instance, when its token names
// its peer listener.
func (l *lease) StreamAbove() int64 {
	if !strings.Contains(l.token, peerMark) {
		return 0
	}
	return int64(l.s.cfg.MaxValueBytes)
}

// Stream implements dedup.StreamingLease.
func (l *lease) Stream(ctx context.Context) error {
	if l.StreamAbove() == 0 {
		return errors.New("rediscache: no peer address advertised")
	}
	// Before the outcome is visible: a renewal racing it must keep it.
	l.streamed.Store(true)
	var kept int64
	err := l.s.exec(ctx, func(ctx context.Context) error {
		var err error
		kept, err = streamScript.Run(ctx, l.s.rdb, l.keys, l.token,
			storecodec.EncodeOutcome(dedup.TooLarge(nil)), l.s.cfg.Lease.Milliseconds(), l.s.channel, fleetevent.Format(fleetevent.FlightEnded, l.tag)).Int64()
		return err
	})
	if err == nil && kept == 0 {
		err = errors.New("rediscache: the flight's lock was lost (it lapsed, and another instance took it)")
	}
	if err != nil {
		l.streamed.Store(false)
	}
	return err
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
			return releaseScript.Run(ctx, l.s.rdb, l.keys, l.token, l.s.channel, fleetevent.Format(fleetevent.FlightEnded, l.tag)).Err()
		})
	})
}

// finish ends l's flight in one round trip: its value, or without one
// (failed, uncacheable, too big for Redis, streamed) its outcome, kept
// only for waiters elsewhere. A value too big for Redis stays in this
// process for its full TTL and reaches the waiters elsewhere once, as the
// outcome.
func (s *Cache) finish(ctx context.Context, l *lease, out dedup.Outcome, ttl time.Duration) error {
	key := l.key
	if out.Entry != nil && ttl > 0 {
		buf := values.Get().(*[]byte)
		value := storecodec.AppendEncode((*buf)[:0], out.Entry)
		if s.shareable(out.Entry, value) {
			err := s.finishValue(ctx, l, value, out.Entry.URLKey, ttl)
			if err == nil {
				// Redis has answered: nothing holds the bytes any more.
				// (After an error the pipeline may still be writing them.)
				if cap(value) <= maxPooledValue {
					*buf = value
					values.Put(buf)
				}
				s.keepShared(key, out.Entry)
			} else {
				// Redis went away during the fetch: the memory tier is
				// the cache now, and Redis gets the value back when it
				// returns.
				s.keepOwn(key, out.Entry, true)
			}
			return err
		}
		s.keepOwn(key, out.Entry, false)
	}
	if l.streamed.Load() {
		// The waiters read the body from our peer listener: the entry
		// need not cross Redis too.
		out = dedup.TooLarge(nil)
	}
	return s.finishOutcome(ctx, l, out)
}

// values are the buffers values are encoded into, for one round trip
// each: a miss need not leave its encoded body to the collector.
var values = sync.Pool{New: func() any { b := make([]byte, 0, 8<<10); return &b }}

// maxPooledValue bounds the buffers values keeps.
const maxPooledValue = 256 << 10

// finishValue stores a flight's value and indexes it under its URL (in
// the URL's slot), pipelined with storedScript, which drops the lock and
// wakes the waiters elsewhere, if any: one round trip whoever waits.
// (Plain commands instead of the script would save Redis about a
// microsecond per miss, measured, but cost a second trip whenever someone
// waits, to publish: the leader's budget is two.)
func (s *Cache) finishValue(ctx context.Context, l *lease, value []byte, urlKey string, ttl time.Duration) error {
	keys := l.keys
	return s.execBatched(ctx, func(ctx context.Context) error {
		_, err := s.evalWith(ctx, storedScript, []string{keys[0], keys[3]}, []any{s.channel, fleetevent.Format(fleetevent.FlightEnded, l.tag)},
			func(p redis.Pipeliner) { p.Set(ctx, keys[1], value, ttl) },
			func(p redis.Pipeliner) { s.index(ctx, p, urlKey, l.tag, ttl) })
		return err
	})
}

// finishOutcome ends a flight without a value in the finish script: the
// outcome is kept for, and the message sent to, waiters elsewhere only.
// An outcome too big to send before knowing whether anyone waits costs a
// second trip when someone does.
func (s *Cache) finishOutcome(ctx context.Context, l *lease, out dedup.Outcome) error {
	keys := l.keys
	outcome := storecodec.EncodeSharedOutcome(out, maxOutcomeBytes, int64(s.cfg.MaxValueBytes))
	blind, follows := outcome, ""
	if len(outcome) > inlineOutcomeBytes {
		blind, follows = nil, "1"
	}
	args := []any{l.token, blind, s.cfg.FailureTTL.Milliseconds(), s.channel, fleetevent.Format(fleetevent.FlightEnded, l.tag), follows}
	var kind int64
	err := s.execBatched(ctx, func(ctx context.Context) error {
		cmd, err := s.evalWith(ctx, finishScript, keys, args, nil, nil)
		if err != nil {
			return err
		}
		kind, err = cmd.Int64()
		return err
	})
	if err == nil && kind == 2 {
		// Someone waits for an outcome too big to have sent blind: sent
		// through the script, which stores it only while the flight is
		// still ours.
		args[1], args[5] = outcome, ""
		err = s.execBatched(ctx, func(ctx context.Context) error {
			_, err := s.evalWith(ctx, finishScript, keys, args, nil, nil)
			return err
		})
	}
	return err
}

// A lease's token names this instance's peer listener when it advertises
// one: "<token>~<address, base64url>". The address is encoded so that the
// token keeps the shape older versions read: they take what precedes the
// first "." for the holder's instance, and base64url has no ".".
const peerMark = "~"

// AdvertisePeer sets the address of this instance's peer listener, which
// the leases it takes from now on name: the fleet's waiters then read
// bodies too big for Redis from it (dedup.StreamingLease). "" stops.
func (s *Cache) AdvertisePeer(addr string) { s.peer.Store(&addr) }

func (s *Cache) peerAddr() string {
	if p := s.peer.Load(); p != nil {
		return *p
	}
	return ""
}

// leaseToken is a new lock token, naming our peer listener if any.
func (s *Cache) leaseToken() string {
	t := s.newToken()
	if addr := s.peerAddr(); addr != "" {
		t += peerMark + base64.RawURLEncoding.EncodeToString([]byte(addr))
	}
	return t
}

// peerOf returns the peer listener a lock token names, unless it is ours;
// nil for none. token was read from Redis: anything that does not look
// like one of ours is no peer, never an error.
func (s *Cache) peerOf(token string) *dedup.Peer {
	head, enc, ok := strings.Cut(token, peerMark)
	if !ok {
		return nil
	}
	addr, err := base64.RawURLEncoding.DecodeString(enc)
	if err != nil || !dedup.ValidPeerAddr(string(addr)) {
		return nil
	}
	instance := head
	if i := strings.IndexAny(head, ".-"); i >= 0 {
		instance = head[:i]
	}
	if instance == "" || instance == s.instance {
		return nil
	}
	return &dedup.Peer{Instance: instance, Addr: string(addr)}
}

// streaming returns the outcome that sends a waiter to the leader's peer
// listener when the lock's holder streams the body (it names a peer and
// keeps the TooLarge outcome beside its lock); nil otherwise.
func (s *Cache) streaming(holder, outcome string) *dedup.Outcome {
	if outcome == "" {
		return nil
	}
	peer := s.peerOf(holder)
	if peer == nil {
		return nil
	}
	out, err := storecodec.DecodeOutcome([]byte(outcome), s.maxBody())
	if err != nil || !out.IsTooLarge() {
		return nil
	}
	out.Peer = peer
	return out
}
