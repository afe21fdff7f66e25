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
	"sync"
	"sync/atomic"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/halfclose"
)

// refreshEvery limits how often the deadline is pushed forward. Setting a
// deadline touches the runtime poller; doing it on every 4 KiB read of a
// large body is measurable, while a one-second slack on a two-minute timeout
// is not. A shorter timeout refreshes at a quarter of itself (see Wrap).
const refreshEvery = time.Second

// Conn is a net.Conn whose deadlines move forward as its Reads and Writes
// are made.
//
// A Read moves the read deadline only; a Write moves both. Bytes coming in
// say nothing of whether the peer takes what is sent to it: a peer that
// sends a byte now and then but never reads (a blind tunnel's client, an
// HTTP/2 client sending PINGs while its response waits) would otherwise
// hold a blocked Write for ever. A Write that goes through, though, shows
// the peer alive, and a Read waiting meanwhile is only a peer with nothing
// to say: a download longer than the timeout (a TLS client sends nothing
// after its handshake) must not be cut by its silent direction, since a
// tunnel closes both ways on an error one way, and net/http cancels a
// request whose background read fails.
//
// Deadlines set by the connection's owner (http.Server's header timeout, a
// handshake bound) still apply: the effective deadline is the earlier of the
// owner's and the idle one, so the idle timeout can shorten an owner's
// deadline but never extend it. A zero owner deadline means "idle only".
//
// A deadline that would not change what is in force is not set again: each
// one takes the runtime poller's lock and moves a timer, and net/http sets
// six per HTTP/1.1 request, most of them back to "none" (here: the idle
// deadline, which moves once a second at most).
type Conn struct {
	halfclose.Conn // CloseWrite, CloseRead and Unwrap pass through

	timeout time.Duration
	every   int64 // nanos between idle refreshes; at most a quarter of timeout
	// The unix nanos of the last idle refresh of each deadline.
	lastRead, lastWrite atomic.Int64

	// mu orders the owner's deadlines and those in force with the
	// deadlines set on the connection: net/http clears the read deadline
	// from the handler while its background reader refreshes it.
	mu             sync.Mutex
	rd, wd         int64 // the owner's read/write deadlines, unix nanos; 0 = none
	inRead, inWrit int64 // the deadlines in force, unix nanos
}

// Wrap returns c with an idle timeout. A timeout <= 0 returns c unchanged.
func Wrap(c net.Conn, timeout time.Duration) net.Conn {
	if timeout <= 0 {
		return c
	}
	// The slack of a refresh is lost from the timeout: a connection whose
	// last bytes moved just short of a refresh is cut that much early. At
	// a fixed second, a timeout of a second or less (fleet.peer_idle_timeout
	// may be set so) fired on connections moving bytes all along.
	every := min(refreshEvery, timeout/4)
	ic := &Conn{Conn: halfclose.Conn{Conn: c}, timeout: timeout, every: int64(every)}
	now := time.Now().UnixNano()
	ic.lastRead.Store(now)
	ic.lastWrite.Store(now)
	_ = ic.apply(true, true, nil)
	return ic
}

// touchRead moves the idle read deadline (see Conn).
func (c *Conn) touchRead() {
	now := time.Now().UnixNano()
	if now-c.lastRead.Load() < c.every {
		return
	}
	c.lastRead.Store(now)
	_ = c.apply(true, false, nil)
}

// touchWrite moves both idle deadlines (see Conn).
func (c *Conn) touchWrite() {
	now := time.Now().UnixNano()
	if now-c.lastWrite.Load() < c.every {
		return
	}
	c.lastWrite.Store(now)
	c.lastRead.Store(max(c.lastRead.Load(), now))
	_ = c.apply(true, true, nil)
}

// apply runs set (nil: nothing), which changes the owner's deadlines, then
// sets the effective read and/or write deadlines on the connection, those
// that changed.
func (c *Conn) apply(read, write bool, set func()) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if set != nil {
		set()
	}
	if read {
		if d := c.effective(c.rd, &c.lastRead); d != c.inRead {
			if err := c.Conn.SetReadDeadline(time.Unix(0, d)); err != nil {
				return err
			}
			c.inRead = d
		}
	}
	if write {
		if d := c.effective(c.wd, &c.lastWrite); d != c.inWrit {
			if err := c.Conn.SetWriteDeadline(time.Unix(0, d)); err != nil {
				return err
			}
			c.inWrit = d
		}
	}
	return nil
}

// effective is the earlier of the owner's deadline and the idle deadline
// that last (the direction's last refresh) sets, in unix nanos.
func (c *Conn) effective(owner int64, last *atomic.Int64) int64 {
	idle := last.Load() + int64(c.timeout)
	if owner != 0 && owner < idle {
		return owner
	}
	return idle
}

func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func (c *Conn) Read(p []byte) (int, error) {
	c.touchRead()
	return c.Conn.Read(p)
}

func (c *Conn) Write(p []byte) (int, error) {
	c.touchWrite()
	return c.Conn.Write(p)
}

// SetDeadline sets the owner's deadline for both directions.
func (c *Conn) SetDeadline(t time.Time) error {
	return c.apply(true, true, func() { c.rd, c.wd = unixNano(t), unixNano(t) })
}

// SetReadDeadline sets the owner's read deadline.
func (c *Conn) SetReadDeadline(t time.Time) error {
	return c.apply(true, false, func() { c.rd = unixNano(t) })
}

// SetWriteDeadline sets the owner's write deadline.
func (c *Conn) SetWriteDeadline(t time.Time) error {
	return c.apply(false, true, func() { c.wd = unixNano(t) })
}
