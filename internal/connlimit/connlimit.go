// Package connlimit is a front door's view of its listening socket: it caps
// the number of live client connections, gives each an idle deadline, and
// keeps track of them so that a shutdown can cut the ones no server tracks
// any more (hijacked CONNECT tunnels, MITM sessions, WebSockets, SOCKS5
// tunnels). The HTTP proxy port and the SOCKS5 port each serve on one.
package connlimit

import (
	"errors"
	"net"
	"sync"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/halfclose"
	"github.com/seed-a3c387e8/onceproxy/internal/idleconn"
)

// Config is what a Listener enforces.
type Config struct {
	// MaxConns caps live client connections; beyond it, new clients wait
	// in the kernel's backlog. Required (at least 1).
	MaxConns int
	// IdleTimeout closes a connection on which nothing moved for this
	// long (see idleconn); 0 means none.
	IdleTimeout time.Duration
}

// Listener wraps a net.Listener with the limits of Config.
type Listener struct {
	net.Listener
	cfg  Config
	sem  chan struct{}
	done chan struct{} // closed by Close: stops an Accept waiting for a slot
	stop sync.Once

	mu     sync.Mutex
	conns  map[*conn]struct{}
	closed bool // CloseAll ran: every connection accepted later is refused
}

// New returns ln with cfg's limits.
func New(ln net.Listener, cfg Config) *Listener {
	return &Listener{
		Listener: ln,
		cfg:      cfg,
		sem:      make(chan struct{}, max(cfg.MaxConns, 1)),
		done:     make(chan struct{}),
		conns:    make(map[*conn]struct{}),
	}
}

// Accept waits for a free connection slot before accepting, so that beyond
// MaxConns new clients queue in the kernel's backlog instead of costing a
// goroutine and a buffer each. A connection gives its slot back when it is
// closed.
func (l *Listener) Accept() (net.Conn, error) {
	select {
	case l.sem <- struct{}{}:
	case <-l.done:
		return nil, net.ErrClosed
	}
	c, err := l.Listener.Accept()
	if err != nil {
		<-l.sem
		return nil, err
	}
	tc := &conn{Conn: halfclose.Conn{Conn: idleconn.Wrap(c, l.cfg.IdleTimeout)}, l: l}
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		c.Close()
		<-l.sem
		return nil, net.ErrClosed
	}
	l.conns[tc] = struct{}{}
	l.mu.Unlock()
	return tc, nil
}

// Close stops accepting; live connections are left alone (see CloseAll).
func (l *Listener) Close() error {
	l.stop.Do(func() { close(l.done) })
	return l.Listener.Close()
}

// Len returns the number of live client connections.
func (l *Listener) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.conns)
}

// CloseAll cuts every live connection: the last step of a shutdown, after
// the grace period for in-flight requests.
func (l *Listener) CloseAll() {
	l.mu.Lock()
	l.closed = true
	conns := make([]*conn, 0, len(l.conns))
	for c := range l.conns {
		conns = append(conns, c)
	}
	l.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
}

// conn is a client connection of a Listener; Close gives its slot back.
type conn struct {
	halfclose.Conn // half-close passes through: tunnels forward a client's EOF

	l    *Listener
	once sync.Once
}

func (c *conn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		c.l.mu.Lock()
		delete(c.l.conns, c)
		c.l.mu.Unlock()
		<-c.l.sem
	})
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}
