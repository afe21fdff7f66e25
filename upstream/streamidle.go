package upstream

import (
	"io"
	"net/http"
	"sync/atomic"
	"time"
)

// streamIdleBody bounds the waits of an HTTP/2 response body for its
// origin's bytes by idle_timeout, as an HTTP/1.1 body's are by its
// connection's (idleconn): a Read that waits that long closes the body
// (RST_STREAM) and fails. An HTTP/2 connection's idle timeout cannot see
// one of its streams stall while others move: an origin that stopped
// mid-body on a busy connection held its client (and, passed through, the
// handler) for as long as the connection stayed busy, or until the
// client's own idle timeout. Only waits in Read count: a body not read
// for a while (its client is slow to take what it was given) is no stall
// of the origin's.
type streamIdleBody struct {
	rc      io.ReadCloser
	idle    time.Duration
	timer   *time.Timer // runs while a Read waits
	expired atomic.Bool
}

// streamIdle wraps resp's body when it comes over HTTP/2.
func streamIdle(resp *http.Response, idle time.Duration) {
	if resp == nil || resp.ProtoMajor != 2 || idle <= 0 || resp.Body == nil || resp.Body == http.NoBody {
		return
	}
	b := &streamIdleBody{rc: resp.Body, idle: idle}
	// Made here, stopped, so that a Close on another goroutine (a flight
	// its last reader left) never races a Read making it.
	b.timer = time.AfterFunc(idle, b.expire)
	b.timer.Stop()
	resp.Body = b
}

func (b *streamIdleBody) Read(p []byte) (int, error) {
	b.timer.Reset(b.idle)
	n, err := b.rc.Read(p)
	b.timer.Stop()
	if err != nil && err != io.EOF && b.expired.Load() {
		err = streamIdleError{b.idle}
	}
	return n, err
}

func (b *streamIdleBody) expire() {
	b.expired.Store(true)
	b.rc.Close()
}

func (b *streamIdleBody) Close() error {
	b.timer.Stop()
	return b.rc.Close()
}

// streamIdleError is a stream given up by streamIdleBody: a timeout.
type streamIdleError struct{ d time.Duration }

func (e streamIdleError) Error() string {
	return "upstream: HTTP/2 response body stalled: no byte for upstream.idle_timeout (" + e.d.String() + ")"
}
func (streamIdleError) Timeout() bool   { return true }
func (streamIdleError) Temporary() bool { return true }
