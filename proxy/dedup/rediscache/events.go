package rediscache

import (
	"context"
	"strings"

	"golang.org/x/sync/errgroup"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// Run keeps the fleet connection alive until ctx ends: the one events
// subscription of this process (flight completions wake local waiters,
// invalidations clear the local tier) and the periodic flush of statistics.
// go-redis re-subscribes by itself after Redis comes back; while the
// subscription is down, waiters fall back on polling.
func (s *Store) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { s.subscribe(ctx); return nil })
	g.Go(func() error { s.flushStats(ctx); return nil })
	g.Go(func() error { s.sendNotes(ctx); return nil })
	return g.Wait()
}

func (s *Store) subscribe(ctx context.Context) {
	ps := s.rdb.Subscribe(ctx, s.channel)
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
			s.handleEvent(m.Payload)
		}
	}
}

// handleEvent applies one message: "d <tag>" a flight ended, "i <tag>" a
// key was invalidated, "u <urlkey>" a URL was invalidated, "n ..." a note
// (notes.go).
func (s *Store) handleEvent(payload string) {
	kind, arg, ok := strings.Cut(payload, " ")
	if !ok {
		return
	}
	switch kind {
	case "d":
		s.waiters.wake(arg)
	case "i":
		_ = s.local.Delete(context.Background(), s.fullKey(arg))
	case "u":
		_, _ = s.local.DeleteURL(context.Background(), arg)
	case "n":
		s.handleNote(arg)
	}
}

func (s *Store) fullKey(tag string) string { return dedup.KeyPrefix + tag }
