package capture

import (
	"net"
	"net/http"
	"sync"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
)

// maxPending bounds the shapes waiting for their handler. A server answers
// requests it rejects without a handler (and HTTP/2 runs many at once), so
// shapes nobody asks for must not pile up; the oldest go first.
const maxPending = 128

// A Conn is a decrypted client connection that records, as a server reads
// it, the client's HTTP/2 preface and the shape of each request. It reads
// the bytes the server reads, in order, and changes none of them.
//
// It has no ConnectionState method, on purpose: net/http takes a connection
// with one for TLS and then no longer recognizes the HTTP/2 preface, so an
// http.Server with Protocols.SetUnencryptedHTTP2 serves a Conn over either
// protocol. (Request.TLS is nil there; the caller knows its TLS state.)
type Conn struct {
	net.Conn
	hello *fingerprint.ClientHello

	mu      sync.Mutex // protects everything below; Read and Shape run in different goroutines
	mode    mode
	sniff   []byte // the first bytes, until they tell HTTP/2 from HTTP/1.x
	h2      *fingerprint.H2Decoder
	h1      h1Scanner
	pending []pending
	fp      *fingerprint.Fingerprint
}

type mode int

const (
	modeSniff mode = iota
	modeH1
	modeH2
	modeOff // the bytes stopped making sense to the tap: pass them on, record nothing more
)

// pending is a request read off the wire, waiting for its handler.
type pending struct {
	method, authority, target string
	shape                     *fingerprint.Shape
}

// NewConn wraps c, the decrypted (or plain) client connection; hello is the
// ClientHello PeekClientHello read before the TLS handshake, nil without
// TLS. The HTTP/2 decoder assumes the server's default 4096-byte HPACK
// table, which net/http and x/net servers keep.
func NewConn(c net.Conn, hello *fingerprint.ClientHello) *Conn {
	return &Conn{Conn: c, hello: hello}
}

// Read reads from the connection and records what it read.
func (c *Conn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.mu.Lock()
		c.observe(p[:n])
		c.mu.Unlock()
	}
	return n, err
}

// observe feeds the bytes read to the parser of the connection's protocol.
func (c *Conn) observe(b []byte) {
	if c.mode == modeSniff {
		k := min(len(fingerprint.ClientPreface)-len(c.sniff), len(b))
		c.sniff = append(c.sniff, b[:k]...)
		switch {
		case string(c.sniff) != fingerprint.ClientPreface[:len(c.sniff)]:
			c.mode = modeH1
		case len(c.sniff) == len(fingerprint.ClientPreface):
			c.mode = modeH2
			c.h2 = fingerprint.NewH2Decoder(4096)
		default:
			return // still a prefix of the preface
		}
		b = append(c.sniff, b[k:]...)
		c.sniff = nil
		if c.mode == modeH1 {
			c.fp = fingerprint.New(c.hello, nil)
		}
	}
	switch c.mode {
	case modeH2:
		if _, err := c.h2.Write(b); err != nil {
			c.mode = modeOff
		}
		if c.fp == nil {
			if pre := c.h2.Preface(); pre != nil {
				c.fp = fingerprint.New(c.hello, pre)
			}
		}
		for _, r := range c.h2.Requests() {
			c.add(pending{method: r.Method, authority: r.Authority, target: r.Path, shape: &r.Shape})
		}
	case modeH1:
		for _, r := range c.h1.write(b) {
			c.add(pending{method: r.Method, target: r.Target, shape: &r.Shape})
		}
		if c.h1.off {
			c.mode = modeOff
		}
	}
}

func (c *Conn) add(p pending) {
	if len(c.pending) == maxPending {
		c.pending = append(c.pending[:0], c.pending[1:]...)
	}
	c.pending = append(c.pending, p)
}

// Fingerprint returns the connection's fingerprint: the hello with, for
// HTTP/2, the preface. It is nil until the first request has been read
// (the protocol is not known before), and stays the same afterwards.
func (c *Conn) Fingerprint() *fingerprint.Fingerprint {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.fp
}

// Shape returns the shape of r, a request the server read from this
// connection, and forgets it; nil when the tap has none (it stopped on
// bytes it could not follow, or gave the shape up under load).
//
// A request is found by what identifies it on the wire: its method and
// target, and on HTTP/2 its authority. Two identical requests in flight on
// one HTTP/2 connection are interchangeable; on HTTP/1.x the requests
// before the one found were never asked for and are dropped.
func (c *Conn) Shape(r *http.Request) *fingerprint.Shape {
	c.mu.Lock()
	defer c.mu.Unlock()
	h2 := r.ProtoMajor == 2
	for i, p := range c.pending {
		if p.method != r.Method || p.target != r.RequestURI || h2 && p.authority != r.Host {
			continue
		}
		if h2 {
			c.pending = append(c.pending[:i], c.pending[i+1:]...)
		} else {
			c.pending = append(c.pending[:0], c.pending[i+1:]...)
		}
		return p.shape
	}
	return nil
}

// NetConn returns the wrapped connection.
func (c *Conn) NetConn() net.Conn { return c.Conn }
