package connlimit

import (
	"context"
	"log/slog"
	"net"
	"time"
)

// AcceptRetrying returns l's next connection. An Accept error that passes
// (out of file descriptors and the like, as passes tells) is logged and
// waited out, the wait growing as net/http's server grows it (5 ms,
// doubling, at most 1 s), rather than spun on or given up on; it stops
// waiting when ctx ends. Any other error, or the last one when ctx ended,
// is returned. Both doors accept with it.
func AcceptRetrying(ctx context.Context, l net.Listener, log *slog.Logger, door string, passes func(error) bool) (net.Conn, error) {
	var wait time.Duration
	for {
		c, err := l.Accept()
		if err == nil || !passes(err) {
			return c, err
		}
		wait = min(max(2*wait, 5*time.Millisecond), time.Second)
		log.Warn(door+": accept failed; retrying", "err", err, "in", wait)
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, err
		}
	}
}
