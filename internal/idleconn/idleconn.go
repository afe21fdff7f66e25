// Package idleconn puts an idle deadline on a net.Conn.
//
// net/http's server timeouts stop applying once a connection is hijacked
// (CONNECT tunnels, WebSockets, goproxy's MITM loop), and an upstream that
// stalls mid-body would otherwise hold a goroutine forever. A Conn from this
// package fails any Read or Write that makes no progress for the timeout, which
// is what "idle" means for a proxy: a slow but moving transfer is fine, a silent
// one is dropped.
package idleconn

import (
	"net"
	"sync/atomic"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/halfclose"
)

// refreshEvery limits how often the deadline is pushed forward. Setting a
// deadline touches the runtime poller; doing it on every 4 KiB read of a
// large body is measurable, while a one-second slack on a two-minute timeout
// is not.
const refreshEvery = time.Second

// Conn is a net.Conn whose deadline moves forward on every Read and Write.
//
// Deadlines set by the connection's owner (http.Server's header timeout, a
// handshake bound) still apply: the effective deadline is the earlier of the
// owner's and the idle one, so the idle timeout can shorten an owner's
// deadline but never extend it. A zero owner deadline means "idle only".
type Conn struct {
	halfclose.Conn // CloseWrite, CloseRead and Unwrap pass through

	timeout time.Duration
	last    atomic.Int64 // unix nanos of the last idle refresh
	rd, wd  atomic.Int64 // the owner's read/write deadlines, unix nanos; 0 = none
}

// Wrap returns c with an idle timeout. A timeout <= 0 returns c unchanged.
func Wrap(c net.Conn, timeout time.Duration) net.Conn {
	if timeout <= 0 {
		return c
	}
	ic := &Conn{Conn: halfclose.Conn{Conn: c}, timeout: timeout}
	ic.touch(true)
	return ic
}

func (c *Conn) touch(force bool) {
	now := time.Now().UnixNano()
	if !force && now-c.last.Load() < int64(refreshEvery) {
		return
	}
	c.last.Store(now)
	_ = c.Conn.SetReadDeadline(c.effective(c.rd.Load()))
	_ = c.Conn.SetWriteDeadline(c.effective(c.wd.Load()))
}

// effective is the earlier of the owner's deadline and the idle deadline.
func (c *Conn) effective(owner int64) time.Time {
	idle := c.last.Load() + int64(c.timeout)
	if owner != 0 && owner < idle {
		return time.Unix(0, owner)
	}
	return time.Unix(0, idle)
}

func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func (c *Conn) Read(p []byte) (int, error) {
	c.touch(false)
	return c.Conn.Read(p)
}

func (c *Conn) Write(p []byte) (int, error) {
	c.touch(false)
	return c.Conn.Write(p)
}

// SetDeadline sets the owner's deadline for both directions.
func (c *Conn) SetDeadline(t time.Time) error {
	c.rd.Store(unixNano(t))
	c.wd.Store(unixNano(t))
	if err := c.Conn.SetReadDeadline(c.effective(c.rd.Load())); err != nil {
		return err
	}
	return c.Conn.SetWriteDeadline(c.effective(c.wd.Load()))
}

// SetReadDeadline sets the owner's read deadline.
func (c *Conn) SetReadDeadline(t time.Time) error {
	c.rd.Store(unixNano(t))
	return c.Conn.SetReadDeadline(c.effective(c.rd.Load()))
}

// SetWriteDeadline sets the owner's write deadline.
func (c *Conn) SetWriteDeadline(t time.Time) error {
	c.wd.Store(unixNano(t))
	return c.Conn.SetWriteDeadline(c.effective(c.wd.Load()))
}
