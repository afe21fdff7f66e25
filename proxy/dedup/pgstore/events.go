package pgstore

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgxlisten"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/fleetevent"
)

// reconnectDelay is the longest the listener waits before reconnecting:
// waiters poll meanwhile, and invalidations and notes sent meanwhile are
// lost to this instance.
const reconnectDelay = time.Second

// listen is the one LISTEN connection of this process, on a connection of
// its own (part of max_conns): flight completions wake local waiters,
// invalidations clear the local tier, notes reach their subscribers. It
// reconnects after losing the database; notifications sent meanwhile are
// lost, so each (re)LISTEN is followed by a re-check of every waiter and a
// recall of the lasting notes.
func (b *Backend) listen(ctx context.Context) {
	l := &pgxlisten.Listener{
		Connect: func(ctx context.Context) (*pgx.Conn, error) {
			ctx, cancel := context.WithTimeout(ctx, b.c.cfg.DialTimeout+b.c.cfg.Timeout)
			defer cancel()
			conn, err := pgx.ConnectConfig(ctx, b.c.listen)
			if err != nil {
				return nil, err
			}
			if err := keepIdle(ctx, conn); err != nil {
				conn.Close(ctx)
				return nil, err
			}
			return conn, nil
		},
		LogError: func(_ context.Context, err error) {
			if ctx.Err() == nil {
				b.c.log.Debug("postgres: listener", "err", err)
			}
		},
		ReconnectDelay: min(b.c.cfg.BreakerInterval, reconnectDelay),
	}
	l.Handle(b.c.channel, (*eventHandler)(b))
	_ = l.Listen(ctx)
}

// eventHandler is the Backend as the listener's handler.
type eventHandler Backend

// HandleNotification implements pgxlisten.Handler.
func (h *eventHandler) HandleNotification(_ context.Context, n *pgconn.Notification, _ *pgx.Conn) error {
	(*Backend)(h).handleEvent(n.Payload)
	return nil
}

// HandleBacklog implements pgxlisten.BacklogHandler: it runs once LISTEN
// is in effect, first at start and then after each reconnect.
func (h *eventHandler) HandleBacklog(context.Context, string, *pgx.Conn) error {
	b := (*Backend)(h)
	b.Cache.waiters.WakeAll()
	if b.c.available() {
		b.Bus.recallAll()
	}
	return nil
}

// handleEvent applies one notification: "d <key>" a flight ended, "i <key>"
// a key was invalidated, "u <urlkey>" a URL was invalidated, "r <key> <ms>"
// a copy cached during an outage replaced an older one, "n ..." a note. Anything else is counted and ignored: another version or a person
// with psql may have sent it.
func (b *Backend) handleEvent(payload string) {
	defer b.c.recoverInput("event")
	b.handleEventUnguarded(payload)
}

// handleEventUnguarded is handleEvent without its recover, for the fuzzer.
func (b *Backend) handleEventUnguarded(payload string) {
	if kind, arg, ok := fleetevent.Parse(payload); ok {
		switch kind {
		case fleetevent.FlightEnded:
			b.Cache.flightEnded(arg)
			return
		case fleetevent.Invalidated:
			b.Cache.invalidated(arg)
			return
		case fleetevent.URLInvalidated:
			b.Cache.invalidatedURL(arg)
			return
		case fleetevent.Replaced:
			if key, ms, ok := fleetevent.ParseReplaced(arg); ok {
				b.Cache.replaced(key, ms)
				return
			}
		case fleetevent.Note:
			if b.Bus.handleNote(arg) {
				return
			}
		}
	}
	b.c.rejected.Add(1)
	b.c.log.Debug("postgres: ignored a notification it cannot read", "payload", clip(payload, 200))
}

func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
