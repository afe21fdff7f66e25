package proxy

import (
	"net"
	"sync"
)

// pushListener is a net.Listener whose connections are pushed in-process
// instead of accepted from the network: intercepted tunnels (of either
// door) into the inner http.Server.
type pushListener struct {
	addr net.Addr
	ch   chan net.Conn
	done chan struct{}
	once sync.Once
}

func newPushListener(addr net.Addr) *pushListener {
	return &pushListener{addr: addr, ch: make(chan net.Conn), done: make(chan struct{})}
}

func (l *pushListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ch:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// push hands c to the http.Server. It fails once the listener is closed
// (shutdownInner closes it).
func (l *pushListener) push(c net.Conn) error {
	select {
	case l.ch <- c:
		return nil
	case <-l.done:
		return net.ErrClosed
	}
}

func (l *pushListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *pushListener) Addr() net.Addr { return l.addr }
