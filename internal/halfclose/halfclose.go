// Package halfclose half-closes TCP connections through the wrappers the
// proxy puts around them (idle deadlines, tracking, byte counting, bytes
// read ahead). A tunnel must pass one side's EOF on without closing the
// other direction, so every wrapper forwards CloseWrite and CloseRead, and
// says what it wraps (Unwrap), so that a tunnel can tell beforehand whether
// a real half-close lies underneath.
package halfclose

import "net"

type writeCloser interface{ CloseWrite() error }
type readCloser interface{ CloseRead() error }
type unwrapper interface{ Unwrap() net.Conn }

// CloseWrite shuts down c's writing side when c (or what it wraps, by its
// own forwarding) can; otherwise it closes c entirely.
func CloseWrite(c net.Conn) error {
	if hc, ok := c.(writeCloser); ok {
		return hc.CloseWrite()
	}
	return c.Close()
}

// CloseRead shuts down c's reading side when it can; otherwise it does
// nothing (the connection closes with its other side).
func CloseRead(c net.Conn) error {
	if hc, ok := c.(readCloser); ok {
		return hc.CloseRead()
	}
	return nil
}

// Supported reports whether CloseWrite on c really half-closes: it looks
// through wrappers (connections with an Unwrap method, whose CloseWrite
// forwards) for a connection with a CloseWrite of its own, such as a
// *net.TCPConn. When it reports false, CloseWrite would close c entirely.
func Supported(c net.Conn) bool {
	for {
		if u, ok := c.(unwrapper); ok {
			c = u.Unwrap()
			continue
		}
		_, ok := c.(writeCloser)
		return ok
	}
}

// Conn is embedded by the proxy's connection wrappers: it forwards
// CloseWrite and CloseRead to the wrapped connection and unwraps to it, so
// a wrapper only writes the methods it changes.
type Conn struct{ net.Conn }

// CloseWrite half-closes the wrapped connection (see the package CloseWrite).
func (c Conn) CloseWrite() error { return CloseWrite(c.Conn) }

// CloseRead shuts down the wrapped connection's reading side when it can.
func (c Conn) CloseRead() error { return CloseRead(c.Conn) }

// Unwrap returns the wrapped connection.
func (c Conn) Unwrap() net.Conn { return c.Conn }
