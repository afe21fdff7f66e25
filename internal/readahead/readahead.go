// Package readahead gives a connection back the bytes its owner read ahead
// of the next one to read it: the version byte a SOCKS5 door checks, what a
// bufio.Reader buffered past a handshake (a client's ClientHello sent right
// behind its CONNECT or SOCKS5 request, an origin's first bytes relayed
// with a gateway's CONNECT reply). Whoever takes the connection over reads
// those bytes first, then the connection itself.
package readahead

import (
	"bufio"
	"net"

	"github.com/seed-a3c387e8/onceproxy/internal/halfclose"
)

// Conn reads its pending bytes, then the wrapped connection. Half-close
// passes through.
type Conn struct {
	halfclose.Conn
	pending []byte
}

// New returns c reading b first. It returns c itself when b is empty. b is
// not copied: the caller must not change it afterwards.
func New(c net.Conn, b []byte) net.Conn {
	if len(b) == 0 {
		return c
	}
	return &Conn{Conn: halfclose.Conn{Conn: c}, pending: b}
}

// Buffered returns c reading first what br, a reader of c, has buffered.
// The bytes are copied, so br may be dropped or reused; br must not be read
// afterwards.
func Buffered(c net.Conn, br *bufio.Reader) net.Conn {
	n := br.Buffered()
	if n == 0 {
		return c
	}
	b, _ := br.Peek(n)
	return New(c, append([]byte(nil), b...))
}

func (c *Conn) Read(p []byte) (int, error) {
	if len(c.pending) > 0 {
		n := copy(p, c.pending)
		c.pending = c.pending[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}
