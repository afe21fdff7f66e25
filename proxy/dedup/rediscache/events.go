package rediscache

import (
	"context"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup/fleetevent"
)

// subscribe is the one events subscription of this process: flight
// completions and invalidations for the cache, notes for the bus.
func (b *Backend) subscribe(ctx context.Context) {
	ps := b.c.rdb.Subscribe(ctx, b.c.channel)
	defer ps.Close()
	ch := ps.Channel()
	for {
		select {
		case <-ctx.Done():
			return
		case m, ok := <-ch:
			if !ok {
				return
			}
			b.handleEvent(m.Payload)
		}
	}
}

// handleEvent applies one message: "d <tag>" a flight ended, "i <tag>" a
// key was invalidated, "u <urlkey>" a URL was invalidated, "n ..." a note.
// Anything else is counted and ignored: another version or a person with
// redis-cli may have written it.
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
		case fleetevent.Note:
			if b.Bus.handleNote(arg) {
				return
			}
		}
	}
	b.c.rejected.Add(1)
	b.c.log.Debug("redis: ignored an event it cannot read", "event", clip(payload, 200))
}

func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
