package proxy

import (
	"errors"
	"net"
	"sync"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/idleconn"

	"github.com/seed-a3c387e8/onceproxy/internal/halfclose"
)

// connListener is the proxy's view of its listening socket: it caps the
// number of live client connections, gives each an idle deadline, and keeps
// track of them so shutdown can cut the ones http.Server has forgotten
// (hijacked CONNECT tunnels, MITM sessions, WebSockets).
type connListener struct {
	net.Listener
	idle time.Duration
	sem  chan struct{}
	done chan struct{} // closed by Close: stops an Accept waiting for a slot
	stop sync.Once

	mu     sync.Mutex
	conns  map[*trackedConn]struct{}
	closed bool
}

func newConnListener(ln net.Listener, maxConns int, idle time.Duration) *connListener {
	return &connListener{
		Listener: ln,
		idle:     idle,
		sem:      make(chan struct{}, maxConns),
		done:     make(chan struct{}),
		conns:    make(map[*trackedConn]struct{}),
	}
}

// Accept waits for a free connection slot before accepting, so that beyond
// MaxConns new clients queue in the kernel's backlog instead of costing us a
// goroutine and a buffer each.
func (l *connListener) Accept() (net.Conn, error) {
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
	tc := &trackedConn{Conn: idleconn.Wrap(c, l.idle), l: l}
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

// Close stops accepting; live connections are left alone (see closeAll).
func (l *connListener) Close() error {
	l.stop.Do(func() { close(l.done) })
	return l.Listener.Close()
}

// Len returns the number of live client connections.
func (l *connListener) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.conns)
}

// closeAll cuts every live connection: the last step of shutdown, after the
// grace period for in-flight requests.
func (l *connListener) closeAll() {
	l.mu.Lock()
	l.closed = true
	conns := make([]*trackedConn, 0, len(l.conns))
	for c := range l.conns {
		conns = append(conns, c)
	}
	l.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
}

type trackedConn struct {
	net.Conn
	l    *connListener
	once sync.Once
}

func (c *trackedConn) Close() error {
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

// CloseWrite and CloseRead keep TCP half-close available through the
// wrappers; goproxy's tunnel only half-closes connections that offer both.
func (c *trackedConn) CloseWrite() error {
	return halfclose.CloseWrite(c.Conn)
}

func (c *trackedConn) CloseRead() error {
	return halfclose.CloseRead(c.Conn)
}
