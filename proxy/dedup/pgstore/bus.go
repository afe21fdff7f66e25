package pgstore

import (
	"context"
	"errors"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/fleetevent"
)

// Bus carries notes, claims and counters between the instances of a
// fleet: upstream session news (upstream.Bus, upstream.Claimer), the
// fleet-wide rate limit (ratelimit.Counter) and the per-day statistics
// (dedup.Recorder, FleetStats).
//
// Notes ride the notification channel the flights already use, as
// "n <instance> <topic> <message>"; an instance ignores its own. Delivery
// is best effort, like every NOTIFY: a note sent while an instance's
// listener is away is lost to it.
//
// A lasting note (a cooldown: true for a while) is also kept in the notes
// table until it expires, in the database's clock, so that an instance
// that subscribes later, or whose listener comes back after an outage,
// hears what the fleet knows.
type Bus struct {
	*client
	stats dedup.DayCounts // flushed each stats_flush

	topics fleetevent.Topics
	out    chan note
}

var _ dedup.Recorder = (*Bus)(nil)

// noteQueue bounds the notes waiting to be sent: a burst (every session
// failing at once) never blocks a request or grows without bound.
const noteQueue = 256

// maxPayload is the largest notification PostgreSQL delivers (it refuses
// 8000 bytes and more).
const maxPayload = 7999

func newBus(c *client) *Bus {
	b := &Bus{client: c, out: make(chan note, noteQueue)}
	// Notes sent while the database was away were lost: catch up on the
	// lasting ones.
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
// unless it would expire sooner) for instances that subscribe later, for
// maxLasting at most. It never blocks: with the queue full (the database
// slow or away) the note is dropped.
func (b *Bus) Publish(topic, key, msg string, ttl time.Duration) {
	if !storable(topic) || !storable(key) || !storable(msg) || strings.Contains(topic, " ") {
		b.log.Debug("postgres: note dropped, not text", "topic", topic)
		return
	}
	n := note{topic: topic, msg: msg}
	if ttl > 0 && key != "" {
		// Longer would be refused when recalled, and swept.
		n.key, n.ttl = key, min(ttl, maxLasting)
	}
	select {
	case b.out <- n:
	default:
		b.log.Debug("postgres: note dropped, queue full", "topic", topic)
	}
}

// Subscribe makes f receive the notes other instances publish on topic, on
// the listener goroutine (f must be quick), and the lasting notes that
// still hold: before Subscribe returns (bounded by postgres.timeout) and
// again each time the listener or the database comes back after an
// outage. One handler per topic.
func (b *Bus) Subscribe(topic string, f func(msg string, left time.Duration)) {
	b.topics.Set(topic, f)
	b.recall(b.life, topic, f)
}

// recall hands f the lasting notes on topic that still hold.
func (b *Bus) recall(ctx context.Context, topic string, f func(msg string, left time.Duration)) {
	var notes []recalled
	bad := 0
	err := b.exec(ctx, func(ctx context.Context) error {
		rows, err := b.pool.Query(ctx, b.sql.recall, topic)
		if err != nil {
			return err
		}
		var msg string
		var ms int64
		_, err = pgx.ForEachRow(rows, []any{&msg, &ms}, func() error {
			if n, ok := recalledNote(msg, ms); ok {
				notes = append(notes, n)
			} else {
				bad++
			}
			return nil
		})
		return err
	})
	if err != nil {
		b.log.Debug("postgres: could not recall the fleet's lasting notes", "topic", topic, "err", err)
		return
	}
	if bad > 0 {
		b.rejected.Add(int64(bad))
		b.log.Debug("postgres: ignored unreadable lasting notes", "topic", topic, "count", bad)
	}
	defer b.recoverInput("recall " + topic)
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

// maxLasting bounds how long a note or a claim lasts: this package writes
// none for longer, so a row that claims to hold longer (an 'infinity' put
// there by hand) was not written by onceproxy. It is ignored when
// recalled, replaced by the next write of its key, and swept.
const maxLasting = 7 * 24 * time.Hour

// recalledNote checks one row of the notes table: what is left of it must
// be positive and bounded.
func recalledNote(msg string, ms int64) (recalled, bool) {
	if ms <= 0 || ms > int64(maxLasting/time.Millisecond) {
		return recalled{}, false
	}
	return recalled{msg: msg, left: time.Duration(ms) * time.Millisecond}, true
}

// sendNotes sends queued notes until ctx ends.
func (b *Bus) sendNotes(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case n := <-b.out:
			payload := fleetevent.FormatNote(b.instance, n.topic, n.msg)
			if len(payload) > maxPayload {
				// Kept for later subscribers, but too long to notify.
				payload = ""
			}
			err := b.exec(ctx, func(ctx context.Context) error {
				switch {
				case n.key != "":
					_, err := b.pool.Exec(ctx, b.sql.keepNote, n.topic, n.key, n.msg, n.ttl.Milliseconds(), b.channel, payload)
					return err
				case payload != "":
					_, err := b.pool.Exec(ctx, b.sql.notify, b.channel, payload)
					return err
				}
				return nil
			})
			if err != nil {
				b.log.Debug("postgres: note not sent", "err", err)
			}
		}
	}
}

// handleNote delivers "<instance> <topic> <message>" to its topic's
// handler. It reports false for a note it cannot read.
func (b *Bus) handleNote(arg string) bool { return b.topics.Deliver(b.instance, arg) }

// Claim makes this instance the fleet's only holder of name for ttl (a row
// that only an expired claim gives way to), maxLasting at most. ok is false
// while another instance holds it; release gives it up early. While the
// database is away every caller gets ok: a claim that cannot be checked
// must not stop the work it guards.
func (b *Bus) Claim(ctx context.Context, name string, ttl time.Duration) (release func(), ok bool) {
	if !storable(name) {
		return func() {}, true
	}
	// Longer would be taken for a claim no instance wrote, and swept.
	ttl = min(ttl, maxLasting)
	token := b.newToken()
	var won bool
	err := b.exec(ctx, func(ctx context.Context) error {
		return b.pool.QueryRow(ctx, b.sql.claim, name, token, ttl.Milliseconds()).Scan(&won)
	})
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil, false
	case err != nil:
		return func() {}, true
	}
	return func() {
		// Not the claimer's context, which may be over; exec bounds it.
		_ = b.exec(context.Background(), func(ctx context.Context) error {
			_, err := b.pool.Exec(ctx, b.sql.unclaim, name, token)
			return err
		})
	}, true
}

// Take implements ratelimit.Counter fleet-wide: one statement per
// request. It fails fast with dedup.ErrUnavailable while the breaker is
// open.
func (b *Bus) Take(ctx context.Context, key string, interval, burst time.Duration) (time.Duration, bool, error) {
	if !storable(key) {
		// A client name that is not text (bytes in a proxy user name)
		// still gets a row of its own.
		key = "x:" + hexKey(key)
	}
	var admitted, refused *int64
	err := b.exec(ctx, func(ctx context.Context) error {
		return b.pool.QueryRow(ctx, b.sql.take, key, interval.Microseconds(), burst.Microseconds()).Scan(&admitted, &refused)
	})
	switch {
	case err != nil:
		return 0, false, err
	case admitted != nil:
		return time.Duration(*admitted) * time.Microsecond, true, nil
	case refused != nil:
		return time.Duration(*refused) * time.Microsecond, false, nil
	default:
		// Refused on a row another instance wrote after this statement's
		// snapshot: its place is unknown, so the whole burst.
		return burst, false, nil
	}
}

// errNotText refuses a binding that PostgreSQL text cannot hold.
var errNotText = errors.New("postgres: binding is not text")

// Bind returns the session the fleet bound key to, binding it to proposal
// first when it is bound to none (upstream.Bindings): one statement. It
// fails fast with dedup.ErrUnavailable while the breaker is open.
func (b *Bus) Bind(ctx context.Context, key, proposal string, ttl time.Duration) (string, error) {
	return b.binding(ctx, b.sql.bind, ttl, key, proposal)
}

// Rebind moves key from `from` to `to` unless another instance moved it
// first, and returns the session it is bound to now (upstream.Bindings):
// one statement.
func (b *Bus) Rebind(ctx context.Context, key, from, to string, ttl time.Duration) (string, error) {
	return b.binding(ctx, b.sql.rebind, ttl, key, from, to)
}

// binding runs a binding statement on texts and the ttl, and returns the
// session the key is bound to.
func (b *Bus) binding(ctx context.Context, sql string, ttl time.Duration, texts ...string) (string, error) {
	args := make([]any, 0, len(texts)+1)
	for _, t := range texts {
		if !storable(t) {
			return "", errNotText
		}
		args = append(args, t)
	}
	args = append(args, ttl.Milliseconds())
	var id string
	err := b.exec(ctx, func(ctx context.Context) error {
		return b.pool.QueryRow(ctx, sql, args...).Scan(&id)
	})
	return id, err
}
