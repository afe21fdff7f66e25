package proxy

import (
	"bytes"
	"encoding/base64"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
)

// The bridge carries a SOCKS5 CONNECT into goproxy as if it had arrived on
// the HTTP port: the SOCKS connection, prefixed with a synthesized
// "CONNECT host:port" (with the SOCKS user in Proxy-Authorization), is
// handed to the Server's own http.Server through an in-process listener.
// handleConnect, the MITM, clientInfo and handle then run unchanged, so the
// two doors cannot drift apart, and http.Server.Shutdown closes the bridge
// with the HTTP listener.

// connectPreamble is the CONNECT request the SOCKS5 door writes on the
// client's behalf. target was checked by checkConnectTarget (no spaces or
// control characters: no header injection). The password travels too, so
// that a Proxy-Authorization check on the HTTP side accepts a SOCKS client
// exactly when it would accept the same credentials over HTTP.
func connectPreamble(target, user, password string, hasCreds bool) string {
	var b strings.Builder
	b.WriteString("CONNECT " + target + " HTTP/1.1\r\nHost: " + target + "\r\n")
	if hasCreds {
		b.WriteString("Proxy-Authorization: Basic " +
			base64.StdEncoding.EncodeToString([]byte(user+":"+password)) + "\r\n")
	}
	b.WriteString("\r\n")
	return b.String()
}

// bridgeConn is a SOCKS5 client connection as the http.Server sees it: its
// reads start with the synthesized CONNECT, then the client's own bytes
// (including those already buffered while sniffing); goproxy's reply to the
// CONNECT is swallowed, since the SOCKS5 reply was sent already. A reply
// other than 200 closes the connection: it is too late for a SOCKS5 error.
type bridgeConn struct {
	net.Conn
	r      io.Reader
	target string
	logger *slog.Logger

	replied atomic.Bool // the CONNECT reply went by; writes pass through
	wmu     sync.Mutex  // guards head until replied
	head    []byte

	closeOnce sync.Once
	done      chan struct{} // closed by Close: the MITM session is over
}

// maxConnectReply bounds the buffered reply to the synthesized CONNECT.
// goproxy's 200 is 19 bytes; an error response is a few hundred.
const maxConnectReply = 4096

var errBridgeRefused = errors.New("socks5 bridge: the proxy refused the tunnel")

func newBridgeConn(c net.Conn, preamble string, client io.Reader, target string, logger *slog.Logger) *bridgeConn {
	return &bridgeConn{
		Conn:   c,
		r:      io.MultiReader(strings.NewReader(preamble), client),
		target: target,
		logger: logger,
		done:   make(chan struct{}),
	}
}

func (c *bridgeConn) Read(p []byte) (int, error) { return c.r.Read(p) }

func (c *bridgeConn) Write(p []byte) (int, error) {
	if c.replied.Load() {
		return c.Conn.Write(p)
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.replied.Load() {
		return c.Conn.Write(p)
	}
	c.head = append(c.head, p...)
	end := bytes.Index(c.head, []byte("\r\n\r\n"))
	if end < 0 {
		if len(c.head) > maxConnectReply {
			c.refuse("reply to CONNECT too long")
			return 0, errBridgeRefused
		}
		return len(p), nil
	}
	line, _, _ := bytes.Cut(c.head, []byte("\r\n"))
	if f := strings.Fields(string(line)); len(f) < 2 || f[1] != "200" {
		c.refuse(string(line))
		return 0, errBridgeRefused
	}
	rest := c.head[end+4:]
	c.head = nil
	c.replied.Store(true)
	if len(rest) > 0 {
		// Not expected from goproxy, but bytes after the reply belong to
		// the client.
		if _, err := c.Conn.Write(rest); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

func (c *bridgeConn) refuse(status string) {
	c.logger.Warn("socks5: the proxy refused the tunnel; closing the SOCKS5 connection",
		"target", c.target, "client", c.RemoteAddr().String(), "reply", status)
	c.Close()
}

func (c *bridgeConn) Close() error {
	err := c.Conn.Close()
	c.closeOnce.Do(func() { close(c.done) })
	return err
}
