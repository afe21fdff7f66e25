// Package halfclose half-closes TCP connections through the wrappers the
// proxy puts around them (idle deadlines, tracking, byte counting, bytes
// read ahead). A tunnel must pass one side's EOF on without closing the
// other direction, so every wrapper forwards CloseWrite and CloseRead.
package halfclose

import "net"

type writeCloser interface{ CloseWrite() error }
type readCloser interface{ CloseRead() error }

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
