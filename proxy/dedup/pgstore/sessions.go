package pgstore

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// A lockSession is one flight connection: a database session whose
// advisory locks are the flights this instance leads there, any number at
// once. Its statements (take a lock, end a flight, give one up) take turns,
// since a connection runs one at a time, and each is a single round trip,
// so a leader holds a lock, not a connection, while it fetches: a few
// sessions serve every flight an instance leads, where a connection per
// flight would cap them at the connection budget (or exhaust the server's
// max_connections across a fleet).
//
// The session is the locks' life: if the process dies, its connections end
// and PostgreSQL releases every lock they held. When a statement fails in
// a way that may leave a lock behind, the session gives that lock up at
// once (an unlock of a lock not held only warns); when even that fails, the
// connection is dropped, and with it the locks of every flight on it: their
// leaders find out at their end (gen) and store their values without them,
// and their waiters elsewhere take over, at worst a second fetch.
type lockSession struct {
	turn chan struct{} // one token: the right to use conn
	conn *pgxpool.Conn // nil until first used, and after it was dropped
	gen  atomic.Uint64 // how many connections were dropped: a lock taken on an older one is gone (written in turn)
	used time.Time     // when conn last ran a statement
}

func newLockSession() *lockSession {
	ls := &lockSession{turn: make(chan struct{}, 1)}
	ls.turn <- struct{}{}
	return ls
}

// errSessionsBusy answers a step that found no turn on a lock session in
// time: the instance is busy, not the database failing, so the breaker
// does not count it.
var errSessionsBusy = errors.New("pgstore: the lock sessions are busy")

// errClosing answers a statement on a lock session once Close began: the
// sessions are ending, and none reconnects.
var errClosing = errors.New("pgstore: closing")

// errLockGone answers a statement about a flight's lock (its end, its
// Stream) once the connection that held the lock was dropped: the lock
// went with it, and another instance may lead the key now. It is found
// before connecting again, which would not bring the lock back.
var errLockGone = errors.New("pgstore: the flight's lock went with its session's connection")

// errTurnLate answers a flight's end that found no turn on its session
// within its wait: the caller hands the end over (lease.end).
var errTurnLate = errors.New("pgstore: the flight's lock session is busy")

// sessionOp says what a statement on a lock session is about.
type sessionOp struct {
	// unlock is the lock a failure of the statement may leave held
	// without a flight to own it (0: none): it is given up on the same
	// session, and the connection is dropped if even that fails.
	unlock int64
	// held: the statement is about a lock taken on the session's
	// connection of generation gen, and does not run (errLockGone) once
	// that connection is gone.
	held bool
	gen  uint64
}

// onSession runs f, a flight's first step (or its Stream), on ls's
// connection in turn, connecting it first when needed; gen is the
// connection's generation, for a lease to compare with the one its lock
// was taken on. ctx bounds the wait for the turn (errSessionsBusy past its
// deadline). The statement itself runs detached from ctx's cancellation,
// within the statement bounds: pgx drops a connection whose query is
// cancelled, and this one holds other flights' locks.
func (c *client) onSession(ctx context.Context, ls *lockSession, op sessionOp, f func(ctx context.Context, conn *pgxpool.Conn, gen uint64) error) error {
	select {
	case <-ls.turn:
	case <-ctx.Done():
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return fmt.Errorf("%w: %w", errSessionsBusy, ctx.Err())
		}
		return ctx.Err()
	}
	defer func() { ls.turn <- struct{}{} }()
	return c.runOnSession(ls, op, c.stepBound(), f)
}

// stepBound bounds a step's statement on a lock session, connecting
// included, and a step's (and an end's) wait for the session's turn.
func (c *client) stepBound() time.Duration { return c.cfg.DialTimeout + c.cfg.Timeout }

// endBound bounds the batch of a flight's end: a statement timeout per
// statement.
func (c *client) endBound() time.Duration { return c.cfg.DialTimeout + 5*c.cfg.Timeout }

// finishBound is the longest a lease's Finish or Release blocks: the wait
// for the session's turn, the end's batch on it, and, when the lock turns
// out gone, the end through the pool.
func (c *client) finishBound() time.Duration { return c.stepBound() + c.endBound() + c.stepBound() }

// endOnSession runs f, the end of a flight whose lock ls took on its
// connection of generation gen (its value and unlock, or its release), in
// turn. It bypasses the breaker: a lock must not outlive its flight because
// the breaker opened on other statements. It waits for the turn up to
// wait (0: as long as it takes, which is never for good: every turn is
// bounded by statement timeouts, Close's too) and returns errTurnLate past
// it without having run f. Once the lock's connection is gone (dropped
// while the end waited, or found dead now), f does not run: errLockGone,
// at once, where connecting again for each end queued behind a dead
// connection would make them wait a dial timeout each, in turn. The batch
// of a flight's end gets a statement timeout per statement.
func (c *client) endOnSession(ls *lockSession, lock int64, gen uint64, wait time.Duration, f func(ctx context.Context, conn *pgxpool.Conn, gen uint64) error) error {
	if wait > 0 {
		select {
		case <-ls.turn:
		default:
			t := time.NewTimer(wait)
			select {
			case <-ls.turn:
				t.Stop()
			case <-t.C:
				return errTurnLate
			}
		}
	} else {
		<-ls.turn
	}
	defer func() { ls.turn <- struct{}{} }()
	err := c.runOnSession(ls, sessionOp{unlock: lock, held: true, gen: gen}, c.endBound(), f)
	if err != nil && !notFailure(err) {
		c.failed.Add(1)
	}
	return err
}

// idlePing is how long a session may sit unused before a ping checks its
// connection (as pgxpool does for its own): a connection that died with a
// server restart is replaced before a flight's statement meets it.
const idlePing = time.Second

// runOnSession is onSession and endOnSession once they hold ls's turn.
func (c *client) runOnSession(ls *lockSession, op sessionOp, timeout time.Duration, f func(ctx context.Context, conn *pgxpool.Conn, gen uint64) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if ls.conn != nil && (ls.conn.Conn().IsClosed() || time.Since(ls.used) > idlePing && ls.conn.Ping(ctx) != nil) {
		c.dropSession(ls)
	}
	if op.held && ls.gen.Load() != op.gen {
		return errLockGone
	}
	if ls.conn == nil && c.life.Err() != nil {
		// Close ends the sessions: none may connect again behind it
		// (pgxpool's Close would wait for that connection for good).
		return errClosing
	}
	if ls.conn == nil {
		conn, err := c.flights.Acquire(ctx)
		if err != nil {
			return err
		}
		ls.conn = conn
	}
	ls.used = time.Now()
	err := f(ctx, ls.conn, ls.gen.Load())
	if err == nil || op.unlock == 0 {
		return err
	}
	if ls.conn.Conn().IsClosed() {
		c.dropSession(ls)
		return err
	}
	uctx, cancel := context.WithTimeout(context.Background(), c.stepBound())
	defer cancel()
	var uerr error
	if ls.conn.Conn().PgConn().TxStatus() != 'I' {
		// A flight's end failed inside its BEGIN: the session refuses
		// everything but the end of that transaction.
		_, uerr = ls.conn.Exec(uctx, "ROLLBACK")
	}
	if uerr == nil {
		_, uerr = ls.conn.Exec(uctx, c.sql.unlock, op.unlock)
	}
	if uerr != nil {
		c.dropSession(ls)
	}
	return err
}

// dropSession ends ls's session, and every lock it held, while holding its
// turn.
func (c *client) dropSession(ls *lockSession) {
	if ls.conn == nil {
		return
	}
	destroy(ls.conn)
	ls.conn = nil
	ls.gen.Add(1)
}

// session picks the session a new flight takes its lock on.
func (c *client) session() *lockSession {
	return c.sessions[int(c.nextSession.Add(1)%uint32(len(c.sessions)))]
}

// closeSessions ends every session, waiting up to wait for a statement
// still running on one; false when it gave up on one (its connection ends
// with the process).
func (c *client) closeSessions(wait time.Duration) bool {
	t := time.NewTimer(wait)
	defer t.Stop()
	for _, ls := range c.sessions {
		select {
		case <-ls.turn:
		case <-t.C:
			return false
		}
		c.dropSession(ls)
		ls.turn <- struct{}{}
	}
	return true
}

// heldLocks are the lock IDs this process's sessions hold: a session's
// advisory locks are re-entrant, so taking one it already holds would
// succeed, and two flights (two keys whose IDs collide) would then lead on
// one lock. A Join whose lock is held here only looks.
type heldLocks struct {
	mu sync.Mutex
	m  map[int64]struct{}
}

// take records lock as held; false when it already is.
func (h *heldLocks) take(lock int64) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.m[lock]; ok {
		return false
	}
	if h.m == nil {
		h.m = make(map[int64]struct{})
	}
	h.m[lock] = struct{}{}
	return true
}

func (h *heldLocks) drop(lock int64) {
	h.mu.Lock()
	delete(h.m, lock)
	h.mu.Unlock()
}
