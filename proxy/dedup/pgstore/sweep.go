package pgstore

import (
	"context"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// sweepBatch is how many rows one sweep statement deletes at most per
// table; a sweep with work left runs sweepRounds statements, and more
// while half its interval lasts.
const (
	sweepBatch   = 1000
	sweepRounds  = 20
	sweepTimeout = 10 * time.Second
)

// sweeper deletes expired rows (and rows whose expiry no instance wrote,
// which would never expire) and keeps the cache table within max_bytes,
// every sweep_interval. Every instance runs one; the sweep
// function's transaction lock makes one of them do the work at a time.
type sweeper struct {
	c                *client
	expired, evicted atomic.Int64 // rows this instance deleted
}

func (w *sweeper) run(ctx context.Context) {
	t := time.NewTicker(w.c.cfg.SweepInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if w.c.available() {
				w.once(ctx)
			}
		}
	}
}

// once sweeps until a round finds nothing more to do. It runs outside the
// breaker and with a longer statement timeout: summing a big table may
// take longer than a request's statement, and says nothing about an
// outage.
func (w *sweeper) once(ctx context.Context) {
	// Rounds go on while there is work, for half an interval at most: a
	// fixed count capped the sweep at sweepRounds × sweepBatch rows per
	// interval, which a fleet writing faster outran for good.
	deadline := time.Now().Add(w.c.cfg.SweepInterval / 2)
	for round := 0; round < sweepRounds || time.Now().Before(deadline); round++ {
		var swept bool
		var expired, evicted int
		err := func() error {
			ctx, cancel := context.WithTimeout(ctx, w.c.cfg.DialTimeout+sweepTimeout)
			defer cancel()
			return pgx.BeginFunc(ctx, w.c.pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, "SET LOCAL statement_timeout = "+strconv.Itoa(int(sweepTimeout.Milliseconds()))); err != nil {
					return err
				}
				if err := tx.QueryRow(ctx, w.c.sql.sweep, w.c.lockID("sweep"), sweepBatch, int64(w.c.cfg.MaxBytes)).Scan(&swept, &expired, &evicted); err != nil || !swept {
					return err
				}
				// Under the sweep's transaction lock still. Kept out of
				// the sweep function, which older builds of the schema
				// version recreate as they know it.
				var absurd int
				err := tx.QueryRow(ctx, w.c.sql.sweepAbsurd, sweepBatch).Scan(&absurd)
				expired += absurd
				return err
			})
		}()
		if err != nil {
			if ctx.Err() == nil {
				w.c.log.Warn("postgres: sweeping expired rows failed", "err", err)
			}
			return
		}
		w.expired.Add(int64(expired))
		w.evicted.Add(int64(evicted))
		if !swept || (expired == 0 && evicted == 0) {
			return
		}
	}
}
