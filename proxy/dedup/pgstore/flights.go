package pgstore

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/fleetevent"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/storecodec"
)

// The states of the acquire function (schema.go).
const (
	stateWait    = 0 // another session holds the key's lock
	stateLocked  = 1 // this session took it: lead
	stateValue   = 2 // the key is cached
	stateOutcome = 3 // the flight waited on ended without a value
	stateFree    = 4 // nobody holds the lock; none was taken
)

// maxUnreadable bounds the unreadable values and outcomes one Join skips:
// past it, something keeps writing what this build cannot read, and the
// flight runs without the fleet.
const maxUnreadable = 3

var errUnreadable = errors.New("pgstore: the shared store keeps returning values this instance cannot use (unreadable, or expired by this machine's clock)")

// Join implements dedup.Fleet.
//
// The first step tries to take the key's advisory lock on one of the
// instance's lock sessions (one round trip: read the value, or take the
// lock and read it again). The instance that takes it leads; the lock
// stays with that session, which serves other flights' statements
// meanwhile (see lockSession), and PostgreSQL releases it by itself if the
// leader dies, because its connections end. The others wait for the
// leader's notification on the instance's one LISTEN connection,
// re-checking on a pooled connection after each notification, after the
// listener reconnects, and when the instance's poll (pollWaits, every
// poll_interval) finds their flight over or its lock free again. A waiter
// never holds a connection while it waits.
//
// With flight_locks flights of this instance leading already, a step only
// looks, on a pooled connection: a value, an outcome or a lock held
// elsewhere work as usual. A key nobody leads waits up to poll_interval
// for a flight to end, and past that gets a lease without a lock: the
// flight still stores its value and wakes the fleet, but another instance
// could fetch the same key meanwhile. A step that finds no turn on its lock
// session within a statement bound does the same (see step).
func (s *Cache) Join(ctx context.Context, key string) (dedup.Lease, *dedup.Outcome, error) {
	if !s.available() || !storable(key) {
		return nil, nil, dedup.ErrUnavailable
	}
	// Marked before the first look, registered once we wait: a message
	// between the look and the wait still wakes us, and a request that
	// leads or finds the value registers nothing.
	mark := s.waiters.Mark(key)
	var wake chan struct{}
	lock := s.lockID(key)
	// slot: this Join holds a flight slot (of flight_locks) for its next step.
	waited, take, slot, unreadable := false, true, false, 0
	for {
		if take && !slot {
			slot = s.trySlot()
		}
		st, val, size, lease, err := s.step(ctx, key, lock, waited, slot)
		slot = false // step gave it back, or the lease holds it
		if err != nil {
			return nil, nil, err
		}
		take = false
		switch st {
		case stateLocked:
			return lease, nil, nil
		case stateValue:
			if s.tooBig(size) {
				s.dropTooBig(key, size, s.sql.dropBigValue, "cached value")
			} else if e, ok := s.decodeValue(ctx, key, val); ok {
				s.putLocal(key, e)
				// Found at once it is a cache hit; found after waiting,
				// it is the result of the flight we waited on.
				return nil, &dedup.Outcome{Entry: e, Cached: !waited}, nil
			}
			if unreadable++; unreadable >= maxUnreadable {
				return nil, nil, errUnreadable
			}
			take = true
			continue
		case stateOutcome:
			if s.tooBig(size) {
				s.dropTooBig(key, size, s.sql.dropBigOutcome, "flight outcome")
			} else if out, ok := s.decodeOutcome(ctx, key, val); ok {
				if out.IsTooLarge() && s.peerAddr() != "" {
					out.Peer = s.peerFor(ctx, key)
				}
				return nil, out, nil
			}
			if unreadable++; unreadable >= maxUnreadable {
				return nil, nil, errUnreadable
			}
			take = true
			continue
		case stateFree:
			if slot = s.waitSlot(ctx); slot {
				take = true
				continue
			}
			return s.unlockedLease(key, flightLocksTaken), nil, nil
		case stateWait:
		default:
			s.rejected.Add(1)
			return nil, nil, errUnreadable
		}
		// Someone else leads: wait for the notification, with the
		// instance's poll (pollWaits) as the safety net for a lost one or
		// a dead leader.
		if !waited {
			waited = true
			wake = s.waiters.Add(key, mark)
			defer s.waiters.Remove(key, wake)
			// Registered first: a wake-up right after the mark finds us.
			// Counted as waiting once marked: the leader's end wakes us
			// from then on (or, when the two cross, the next poll does).
			ended := s.markWaiting(ctx, key)
			s.fleetWaits.Add(1)
			defer s.fleetWaits.Add(-1)
			if ended {
				continue
			}
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
// statement per poll_interval finds the keys this instance waits on whose
// flight ended (a lost notification, or a mark and an end that crossed)
// or lost its leader (its lock is free: the leader died).
func (s *Cache) pollWaits(ctx context.Context) {
	s.waiters.Poll(ctx, s.cfg.PollInterval, func(ctx context.Context, keys []string) (ready []string, err error) {
		locks := make([]int64, len(keys))
		for i, k := range keys {
			locks[i] = s.lockID(k)
		}
		err = s.exec(ctx, func(ctx context.Context) error {
			rows, err := s.pool.Query(ctx, s.sql.pollWaits, keys, locks)
			if err != nil {
				return err
			}
			ready, err = pgx.CollectRows(rows, pgx.RowTo[string])
			return err
		})
		return ready, err
	})
}

// step runs the acquire function once: with a flight slot, on one of the
// lock sessions, taking the lock; without, only looking, on a pooled
// connection. A taken lock comes back as a lease that holds the slot;
// otherwise the slot is given back. size is the size of the value or
// outcome found, whose bytes (val) come only up to max_value_bytes.
func (s *Cache) step(ctx context.Context, key string, lock int64, waited, slot bool) (state int32, val []byte, size int32, l *lease, err error) {
	ours := false
	if slot && !s.held.take(lock) {
		// One of our sessions holds this lock already (a key whose ID
		// collides with a flight of ours): look, as if it were held
		// elsewhere.
		<-s.slots
		slot, ours = false, true
	}
	if !slot {
		err = s.exec(ctx, func(ctx context.Context) error {
			return s.pool.QueryRow(ctx, s.sql.acquire, lock, key, waited, false, int64(s.cfg.MaxValueBytes)).Scan(&state, &val, &size)
		})
		if ours && err == nil && state == stateFree {
			// Free in the database, ours here: the session of a flight
			// of ours lost it (its connection ended). Wait for that
			// flight, as for anyone's, rather than look again at once,
			// and again, until it ends.
			state = stateWait
		}
		return state, val, size, nil, err
	}
	ls := s.session()
	var gen uint64
	err = s.exec(ctx, func(ctx context.Context) error {
		return s.onSession(ctx, ls, sessionOp{unlock: lock}, func(ctx context.Context, conn *pgxpool.Conn, g uint64) error {
			gen = g
			return conn.QueryRow(ctx, s.sql.acquire, lock, key, waited, true, int64(s.cfg.MaxValueBytes)).Scan(&state, &val, &size)
		})
	})
	if err != nil || state != stateLocked {
		s.held.drop(lock)
		<-s.slots
		if isLockTableFull(err) {
			return stateLocked, nil, 0, s.unlockedLease(key, lockTableFull), nil
		}
		if errors.Is(err, errSessionsBusy) && ctx.Err() == nil {
			// Every turn on the session was taken for a whole statement
			// bound: a burst, not a failing database. Look on a pooled
			// connection instead, and lead a key nobody leads without the
			// lock, rather than send the request past the fleet
			// (BYPASS): a value or a flight found elsewhere is still
			// shared, and the flight still stores its value.
			state, val, size, _, err = s.step(ctx, key, lock, waited, false)
			if err == nil && state == stateFree {
				return stateLocked, nil, 0, s.unlockedLease(key, sessionsBusy), nil
			}
		}
		return state, val, size, nil, err
	}
	s.leases.Add(1)
	return state, nil, 0, &lease{s: s, key: key, lock: lock, sess: ls, gen: gen}, nil
}

// tooBig reports a value or outcome bigger than max_value_bytes, which
// this instance never writes (step and readShared read its size alone).
func (s *Cache) tooBig(size int32) bool { return int64(size) > int64(s.cfg.MaxValueBytes) }

// dropTooBig removes key's value or outcome (what, for the log) of size
// bytes, too big to read, with sql (dropBigValue, dropBigOutcome), unless
// replaced meanwhile by one that is not: it is input this instance cannot
// use, counted as such, and the key is a miss. Left in place, it would cost
// every reader of the key its whole transfer, each timeout counted by the
// breaker as the database failing.
//
// Deleting a row deletes each chunk of its stored value, which for a
// huge one takes longer than a request's statement: the delete runs in
// the background, once per row at a time, with the sweep's statement
// timeout and outside the breaker (as the sweep does, for the same
// reason); the caller answers a miss at once.
func (s *Cache) dropTooBig(key string, size int32, sql, what string) {
	s.rejected.Add(1)
	id := what + " " + key
	if _, busy := s.dropping.LoadOrStore(id, struct{}{}); busy {
		return
	}
	s.log.Warn("postgres: dropping a "+what+" bigger than max_value_bytes (written by hand, or by an instance with a larger limit)",
		"key", key, "bytes", size, "max_value_bytes", s.cfg.MaxValueBytes)
	if !s.background(func(ctx context.Context) {
		defer s.dropping.Delete(id)
		ctx, cancel := context.WithTimeout(ctx, s.cfg.DialTimeout+sweepTimeout)
		defer cancel()
		err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "SET LOCAL statement_timeout = "+strconv.Itoa(int(sweepTimeout.Milliseconds()))); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, sql, key, int64(s.cfg.MaxValueBytes))
			return err
		})
		if err != nil && ctx.Err() == nil {
			s.log.Warn("postgres: could not drop a "+what+" bigger than max_value_bytes", "key", key, "err", err)
		}
	}) {
		s.dropping.Delete(id)
	}
}

// trySlot takes a flight slot (of flight_locks) if one is free now.
func (s *Cache) trySlot() bool {
	select {
	case s.slots <- struct{}{}:
		return true
	default:
		return false
	}
}

// waitSlot takes a flight slot, waiting up to poll_interval.
func (s *Cache) waitSlot(ctx context.Context) bool {
	if s.trySlot() {
		return true
	}
	t := time.NewTimer(s.cfg.PollInterval)
	defer t.Stop()
	select {
	case s.slots <- struct{}{}:
		return true
	case <-t.C:
	case <-ctx.Done():
	}
	return false
}

// Why a flight leads without the key's lock (unlockedLease).
const (
	// This instance leads flight_locks flights with a lock already.
	flightLocksTaken = iota
	// The server's lock table, which the fleet shares, is full.
	lockTableFull
	// This instance's lock sessions found no turn for a step in time.
	sessionsBusy
)

// unlockedLease leads a flight without the key's lock, for why.
func (s *Cache) unlockedLease(key string, why int) *lease {
	s.unlocked.Add(1)
	now := time.Now().Unix()
	if last := s.lastUnlockedLog.Load(); now-last >= 60 && s.lastUnlockedLog.CompareAndSwap(last, now) {
		switch why {
		case lockTableFull:
			s.log.Warn("postgres: the server's lock table is full; new flights run without the fleet lock (raise the server's max_locks_per_transaction, or lower postgres.flight_locks across the fleet)",
				"flight_locks", s.cfg.FlightLocks)
		case sessionsBusy:
			s.log.Warn("postgres: the lock sessions found no turn within a statement bound; new flights run without the fleet lock (raise postgres.flight_conns, or look for slow statements)",
				"flight_conns", s.cfg.FlightConns, "timeout", s.cfg.Timeout)
		default:
			s.log.Warn("postgres: this instance leads flight_locks flights with a lock already; new flights run without the fleet lock (raise postgres.flight_locks)",
				"flight_locks", s.cfg.FlightLocks)
		}
	}
	// Without the lock, but with its ID: the flight's outcome is written
	// only while nobody else holds it (setOutcome).
	return &lease{s: s, key: key, lock: s.lockID(key)}
}

// isLockTableFull reports the server's "out of shared memory" for a lock
// (SQLSTATE 53200, with max_locks_per_transaction in its hint). The
// session gave up whatever lock the statement took (onSession), and the
// breaker does not count it (exec): a burst of flights past the table is
// not the database failing, and must not switch the fleet's sharing off.
func isLockTableFull(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "53200"
}

// decodeOutcome reads a flight's outcome; one this build cannot read is
// counted and removed unless replaced meanwhile.
func (s *Cache) decodeOutcome(ctx context.Context, key string, blob []byte) (*dedup.Outcome, bool) {
	out, err := storecodec.DecodeOutcome(blob, s.maxBody())
	if err == nil {
		return out, true
	}
	s.rejected.Add(1)
	s.log.Debug("postgres: ignored a flight outcome it cannot read", "key", key, "err", err)
	sum := md5.Sum(blob)
	_ = s.exec(ctx, func(ctx context.Context) error {
		_, err := s.pool.Exec(ctx, s.sql.dropOutcome, key, hex.EncodeToString(sum[:]))
		return err
	})
	return nil, false
}

// destroy ends a connection's session (and so every advisory lock it
// holds) instead of giving it back to its pool.
func destroy(conn *pgxpool.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = conn.Hijack().Close(ctx)
}

// lease is one fleet flight this process leads: with sess, it holds the
// key's lock on that session (while its connection is the one of
// generation gen) until Finish or Release.
type lease struct {
	s    *Cache
	key  string
	lock int64        // the key's lock ID (held only with sess)
	sess *lockSession // nil: led without a lock
	gen  uint64
	once sync.Once
	// streamed: the waiters read the body from our peer listener (a row
	// beside the outcome names it), until the end of the download.
	streamed bool
}

// done forgets the lease's lock and frees its flight slot.
func (l *lease) done() {
	if l.sess == nil {
		return
	}
	l.sess = nil
	l.s.held.drop(l.lock)
	<-l.s.slots
	l.s.leases.Done()
}

// end runs a lease's last statement, then after with its error (the
// lease's bookkeeping, which also frees it: done), and returns that.
// locked runs on the session that holds the lock (endOnSession: whatever
// the caller's context or the breaker say, a lock must not outlive its
// flight); lost runs through the pool and the breaker when the lease has
// no lock or its lock went with a dropped connection.
//
// end blocks at most finishBound (Lease's contract). A session busy past
// the end's wait for its turn (stepBound: a queue of other statements,
// each within its bounds) gets the end handed over to a goroutine that waits for the turn as long as it
// takes, so the lock still goes with the flight; it holds the lease
// (c.leases, which Close waits for) until then, and end returns nil: the
// end is not lost, only late.
func (l *lease) end(ctx context.Context, locked func(ctx context.Context, conn *pgxpool.Conn) error, lost func(ctx context.Context) error, after func(err error) error) error {
	ls, s := l.sess, l.s
	if ls == nil || ls.gen.Load() != l.gen {
		return after(l.endLost(ctx, lost))
	}
	run := func(ctx context.Context, conn *pgxpool.Conn, _ uint64) error { return locked(ctx, conn) }
	err := s.endOnSession(ls, l.lock, l.gen, s.stepBound(), run)
	if !errors.Is(err, errTurnLate) {
		if errors.Is(err, errLockGone) {
			err = l.endLost(ctx, lost)
		}
		return after(err)
	}
	s.log.Debug("postgres: a flight's lock session is busy; its end goes on in the background", "key", l.key)
	// The caller's context may end once we return; the statements keep
	// their own bounds.
	ctx = context.WithoutCancel(ctx)
	go func() {
		err := s.endOnSession(ls, l.lock, l.gen, 0, run)
		if errors.Is(err, errLockGone) {
			err = l.endLost(ctx, lost)
		}
		if err = after(err); err != nil {
			s.log.Warn("postgres: could not share a flight's outcome with the fleet", "key", l.key, "err", err)
		}
	}()
	return nil
}

// endLost runs lost, the end of a flight without its lock, through the
// pool and the breaker.
func (l *lease) endLost(ctx context.Context, lost func(ctx context.Context) error) error {
	if l.sess != nil {
		l.s.log.Warn("postgres: a flight's lock went with its session's connection; ending it without the lock", "key", l.key)
	}
	return l.s.exec(ctx, lost)
}

// StreamAbove implements dedup.StreamingLease: bodies bigger than a value
// in the table may be are read from this instance, when it advertises a
// peer listener and holds the key's lock (a flight led without it would
// send waiters to a download another instance may duplicate).
func (l *lease) StreamAbove() int64 {
	if l.sess == nil || l.s.peerAddr() == "" {
		return 0
	}
	return int64(l.s.cfg.MaxValueBytes)
}

// errNotStreaming refuses a Stream that would send the fleet's waiters to
// a download this instance may not own.
var errNotStreaming = errors.New("pgstore: no peer address advertised, or the flight runs without the lock")

// Stream implements dedup.StreamingLease: the TooLarge outcome and the
// row naming our peer listener, written together, and the wake-up of the
// waiters. The lock stays held by the flight's connection.
//
// It runs on that session, in turn, and writes only while the flight still
// has the key's lock (or nobody else took it): a leader whose lock went
// with a dropped connection or a session reset, while another instance
// took the key's next flight, must not send that flight's waiters here.
func (l *lease) Stream(ctx context.Context) error {
	s := l.s
	if l.StreamAbove() == 0 {
		return fmt.Errorf("stream: %w", errNotStreaming)
	}
	var wrote bool
	err := s.exec(ctx, func(ctx context.Context) error {
		return s.onSession(ctx, l.sess, sessionOp{held: true, gen: l.gen}, func(ctx context.Context, conn *pgxpool.Conn, _ uint64) error {
			tag, err := conn.Exec(ctx, s.sql.stream, l.key, storecodec.EncodeOutcome(dedup.TooLarge(nil)),
				peerRowKey(l.key), encodePeer(s.instance, s.peerAddr()), streamingTTL.Milliseconds(), s.channel,
				fleetevent.Format(fleetevent.FlightEnded, l.key), l.lock)
			wrote = tag.RowsAffected() > 0
			return err
		})
	})
	switch {
	case errors.Is(err, errLockGone):
		return fmt.Errorf("stream: %w: %w", errNotStreaming, err)
	case err != nil:
		return fmt.Errorf("stream: %w", err)
	case !wrote:
		return fmt.Errorf("stream: %w: another session holds the key's lock", errNotStreaming)
	}
	l.streamed = true
	return nil
}

// Finish implements dedup.Lease. It blocks at most finishBound: 3 ×
// dial_timeout + 7 × timeout (the session's turn, the end's batch, the end
// without the lock).
func (l *lease) Finish(ctx context.Context, out dedup.Outcome, ttl time.Duration) error {
	var err error
	l.once.Do(func() { err = l.s.finish(ctx, l, out, ttl) })
	return err
}

// Release implements dedup.Lease: the lock goes and the waiters wake, so
// one of them takes over at once. It blocks at most as long as Finish.
func (l *lease) Release() {
	l.once.Do(func() {
		s := l.s
		// Nobody's context: the end without the lock has exec's bounds,
		// the rest endOnSession's.
		ctx := context.Background()
		payload := fleetevent.Format(fleetevent.FlightEnded, l.key)
		_ = l.end(ctx, func(ctx context.Context, conn *pgxpool.Conn) error {
			_, err := conn.Exec(ctx, s.sql.release, l.lock, s.channel, payload)
			return err
		}, func(ctx context.Context) error {
			// A wake-up alone: waiters re-check, and wait on whoever
			// leads now.
			_, err := s.pool.Exec(ctx, s.sql.notify, s.channel, payload)
			return err
		}, func(err error) error {
			l.done()
			return err
		})
	})
}

// finish stores the value (or the short-lived outcome for waiters),
// notifies every instance, and releases the lock, in one round trip on the
// lock's session: BEGIN, the write with its notification, COMMIT, and the
// unlock after the commit, so that whoever takes the lock next sees the
// value.
func (s *Cache) finish(ctx context.Context, l *lease, out dedup.Outcome, ttl time.Duration) error {
	var value, outcome []byte
	if out.Entry != nil && ttl > 0 {
		value = storecodec.Encode(out.Entry)
		if !s.shareable(out.Entry, value) || !storable(out.Entry.URLKey) {
			// Too big to share as a cached value: this instance caches
			// it; the waiters elsewhere still need it, once.
			_ = s.local.Set(ctx, l.key, out.Entry, ttl)
			value = nil
		}
	}
	if value == nil && l.streamed {
		// The waiters read the body from our peer listener: the entry
		// need not cross the database too.
		out = dedup.TooLarge(nil)
	}
	var sql string
	var args []any
	payload := fleetevent.Format(fleetevent.FlightEnded, l.key)
	if value != nil {
		sql = s.sql.finishValue
		args = []any{l.key, out.Entry.URLKey, value, out.Entry.StoredAt, ttl.Milliseconds(), s.channel, payload, waitRowKey(l.key)}
	} else {
		outcome = storecodec.EncodeSharedOutcome(out, int64(s.cfg.MaxValueBytes), int64(s.cfg.MaxValueBytes))
		// Written only while no other session holds the lock (see
		// setOutcome): on the lock's session as a check that costs
		// nothing, and through the pool, for a lease without it, as the
		// only way not to answer another leader's waiters. A value needs
		// no such check: whoever leads fetches the same response.
		sql = s.sql.setOutcome
		args = []any{l.key, outcome, s.cfg.FailureTTL.Milliseconds(), s.channel, payload, waitRowKey(l.key), l.lock}
	}
	err := l.end(ctx, func(ctx context.Context, conn *pgxpool.Conn) error {
		b := &pgx.Batch{}
		b.Queue("BEGIN")
		b.Queue(sql, args...)
		if l.streamed {
			// Kept only as long as an outcome: the body may still be
			// in our cache for a late waiter.
			b.Queue(s.sql.expirePeer, peerRowKey(l.key), s.cfg.FailureTTL.Milliseconds(), l.lock)
		}
		b.Queue("COMMIT")
		var unlocked bool
		b.Queue(s.sql.unlock, l.lock).QueryRow(func(r pgx.Row) error { return r.Scan(&unlocked) })
		if err := conn.SendBatch(ctx, b).Close(); err != nil {
			return err
		}
		if !unlocked {
			// The value is stored, but the lock was not this
			// session's any more (the session was reset under the
			// flight, and the other flights' locks with it): ending
			// the session is the only sure way none of them lingers.
			s.log.Warn("postgres: a flight's lock was not held at its end; closing its session", "key", l.key)
			s.dropSession(l.sess)
		}
		return nil
	}, func(ctx context.Context) error {
		_, err := s.pool.Exec(ctx, sql, args...)
		return err
	}, func(err error) error {
		l.done()
		if value != nil {
			if err == nil {
				s.putLocal(l.key, out.Entry)
			} else {
				s.keepLocal(l.key, out.Entry)
			}
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("finish: %w", err)
	}
	return nil
}

// The peer listener of a flight's leader that streams its body is a row of
// the outcomes table beside the flight's TooLarge outcome, under
// peerRowKey: instances of older versions read outcomes by the flight's
// own key only, so the outcome they find is the one they know ("fetch
// your own"), and the schema is unchanged. Its value is "p1 <instance>
// <address>".
//
// streamingTTL bounds both rows of a leader that dies mid-download (its
// lock goes with its session; the next leader's lock drops the outcome,
// and a row naming a dead peer costs a waiter a refused connection and its
// own download). Finish cuts them to failure_ttl.
const streamingTTL = time.Hour

func peerRowKey(key string) string { return "peer " + key }

// A waiter marks the flight it waits for with a row of the outcomes table
// under waitRowKey (as peerRowKey, invisible to older versions, which read
// outcomes by the flight's own key), and the flight's end wakes the fleet
// only when the mark is there. Older versions' waiters do not mark: they
// notice a flight led by this version at their next poll. waitMarkTTL
// outlasts any wait (a flight's deadline and its margin); a flight that
// outlasts it ends without the wake-up, and its waiters notice at their
// next poll too.
func waitRowKey(key string) string { return "wait " + key }

const waitMarkTTL = 10 * time.Minute

// markWaiting marks key's flight as waited on; true when the flight ended
// with a value meanwhile: look again instead of waiting. (An outcome is
// not looked for here: the outcome of the flight before may still be
// there, its removal not yet committed by the new leader's lock.) A mark
// and an end that cross (neither statement sees the other's row) cost the
// waiter a poll_interval; so does a mark that cannot be written, and
// nothing else.
func (s *Cache) markWaiting(ctx context.Context, key string) bool {
	var ended bool
	err := s.exec(ctx, func(ctx context.Context) error {
		return s.pool.QueryRow(ctx, s.sql.markWaiting, waitRowKey(key), waitMarkTTL.Milliseconds(), key).Scan(&ended)
	})
	return err == nil && ended
}

func encodePeer(instance, addr string) []byte { return []byte("p1 " + instance + " " + addr) }

// decodePeer parses a peer row; ok is false for anything this build did
// not write.
func decodePeer(b []byte) (instance, addr string, ok bool) {
	rest, ok := strings.CutPrefix(string(b), "p1 ")
	if !ok {
		return "", "", false
	}
	instance, addr, ok = strings.Cut(rest, " ")
	if !ok || instance == "" || len(instance) > 64 || !dedup.ValidPeerAddr(addr) {
		return "", "", false
	}
	return instance, addr, true
}

// AdvertisePeer sets the address of this instance's peer listener: the
// flights it leads from now on send the fleet's waiters there for bodies
// too big for the table (dedup.StreamingLease). "" stops.
func (s *Cache) AdvertisePeer(addr string) { s.peer.Store(&addr) }

func (s *Cache) peerAddr() string {
	if p := s.peer.Load(); p != nil {
		return *p
	}
	return ""
}

// peerFor reads the peer listener the leader of key's flight named, for
// a waiter told the body is too big for the table; nil when there is
// none, it is ours, or it cannot be read.
func (s *Cache) peerFor(ctx context.Context, key string) *dedup.Peer {
	var blob []byte
	err := s.exec(ctx, func(ctx context.Context) error {
		return s.pool.QueryRow(ctx, s.sql.peer, peerRowKey(key)).Scan(&blob)
	})
	if err != nil {
		return nil // none (no rows), or the database is away: fetch our own
	}
	instance, addr, ok := decodePeer(blob)
	if !ok {
		s.rejected.Add(1)
		return nil
	}
	if instance == s.instance {
		return nil
	}
	return &dedup.Peer{Instance: instance, Addr: addr}
}
