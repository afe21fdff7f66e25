package socks

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"time"

	"github.com/things-go/go-socks5/statute"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/capture"
	"github.com/seed-a3c387e8/onceproxy/internal/httpstatus"
	"github.com/seed-a3c387e8/onceproxy/internal/readahead"
)

// stream is one SOCKS5 CONNECT on its way to the pipeline or upstream.
type stream struct {
	s    *Server
	conn net.Conn      // the client
	r    *bufio.Reader // reads conn, with what the handshake and sniffing read ahead
	t    Tunnel
	host string
	port int
	ctx  context.Context // the door's, with the policy's decision on t.Target
}

// serve checks the target, then sniffs or dials first (see the package
// doc). It sets *handedOver when the client connection went to the
// pipeline, which then closes it.
func (st *stream) serve(handedOver *bool) error {
	ctx, err := st.s.o.Pipeline.CheckTunnel(st.s.ctx, st.t)
	if err != nil {
		code := replyCode(err)
		st.s.o.Logger.Warn("socks5: refused CONNECT", "target", st.t.Target, "client", st.t.Client,
			"reply", code, "err", err)
		_ = sendReply(st.conn, code, nil)
		return nil
	}
	st.ctx = ctx
	bypass := st.s.o.Bypass.Match(st.host)
	if st.s.cfg.isMITMPort(st.port) && !bypass {
		return st.sniffFirst(handedOver)
	}
	return st.dialFirst(bypass, handedOver)
}

// sniffFirst serves a CONNECT to a MITM port: the usual case (HTTPS, HTTP)
// is answered at once and intercepted without dialling anything; a stream
// that is neither is tunnelled after the fact. A client still silent after
// sniff_timeout may be waiting for a server-speaks-first greeting: the
// upstream is dialled, and whichever side speaks first decides (a slow
// TLS client is still intercepted, and so is an HTTP client still in the
// middle of its method at the timeout). A failed dial can only close the
// connection: the SOCKS5 reply is sent.
func (st *stream) sniffFirst(handedOver *bool) error {
	if err := sendReply(st.conn, statute.RepSuccess, st.conn.LocalAddr()); err != nil {
		return fmt.Errorf("reply: %w", err)
	}
	kind := sniff(st.r, &sniffer{conn: st.conn}, st.s.cfg.SniffTimeout)
	client := io.Reader(st.r)
	switch kind {
	case sniffTLS:
		// Nothing dialled yet: a hello the pipeline sends blind
		// (BlindHello) is dialled once, there.
		c, blind := st.tlsGoesBlind(false)
		if !blind {
			st.intercept(c, handedOver)
			return nil
		}
		client = c
	case sniffHTTP:
		st.intercept(readahead.Buffered(st.conn, st.r), handedOver)
		return nil
	case sniffClosed:
		return nil
	}
	up, err := st.s.o.Pipeline.DialTunnel(st.ctx, st.t)
	if err != nil {
		st.s.o.Logger.Warn("socks5: tunnel failed after the reply; closing", "target", st.t.Target,
			"client", st.t.Client, "sniffed", kind.String(), "err", err)
		return nil
	}
	if kind == sniffOther || kind == sniffTLS {
		return st.splice(client, up, up)
	}
	return st.firstSpeakerDecides(up, handedOver)
}

// tlsGoesBlind reads the TLS hello of a stream, when it may decide
// anything, and reports whether the stream goes blind rather than into
// the pipeline:
//
//   - its server name is a bypass host, the target being an IP address. A
//     SOCKS5 client that resolves names itself (curl's socks5://, most
//     SOCKS libraries) sends only the address, which the bypass list
//     cannot match by name: without this, a pinned host on the list would
//     be intercepted and fail its client's pinning.
//   - dialled (the upstream is open already), BlindHello says so. The
//     pipeline would decide the same, but dial again for it: the origin
//     saw an empty connection come and go, and the rate limit counted the
//     tunnel twice.
//
// The returned connection replays every byte read, the hello included,
// for the pipeline or the tunnel.
func (st *stream) tlsGoesBlind(dialled bool) (net.Conn, bool) {
	c := readahead.Buffered(st.conn, st.r)
	byName := st.s.o.Bypass.Len() > 0 && net.ParseIP(st.host) != nil
	if !byName && !dialled {
		return c, false
	}
	_ = st.conn.SetReadDeadline(time.Now().Add(st.s.o.HandshakeTimeout))
	c, hello, err := capture.PeekClientHello(c)
	_ = st.conn.SetReadDeadline(time.Time{})
	if err != nil {
		// Not a hello to read: the pipeline's handshake answers it (and
		// a client that stalls meets its deadline there).
		return c, false
	}
	if dialled && BlindHello(hello) {
		return c, true
	}
	return c, byName && hello.ServerName != "" && st.s.o.Bypass.Match(hello.ServerName)
}

// dialFirst serves a CONNECT to any other port, or to a bypass host: dial
// the upstream first, so that a failure becomes a SOCKS5 reply code, then
// tunnel. A stream to another port that turns out to be TLS or HTTP is
// still intercepted, at the cost of the dial made for nothing.
func (st *stream) dialFirst(bypass bool, handedOver *bool) error {
	up, err := st.s.o.Pipeline.DialTunnel(st.ctx, st.t)
	if err != nil {
		code := replyCode(err)
		st.s.o.Logger.Warn("socks5: tunnel failed", "target", st.t.Target, "client", st.t.Client,
			"reply", code, "err", err)
		_ = sendReply(st.conn, code, nil)
		return nil
	}
	if err := sendReply(st.conn, statute.RepSuccess, st.conn.LocalAddr()); err != nil {
		up.Close()
		return fmt.Errorf("reply: %w", err)
	}
	if bypass {
		return st.splice(st.r, up, up)
	}
	return st.firstSpeakerDecides(up, handedOver)
}

// firstSpeakerDecides sniffs the client while the dialled upstream may
// already be talking. If the client speaks first, its bytes decide (TLS or
// HTTP: intercept; else tunnel); if the upstream does (a server-speaks-first
// protocol), the stream is tunnelled at once. No timeout but the idle one:
// until somebody speaks there is nothing to forward, so waiting costs no
// latency, and a client slowed down by load is never mistaken for a silent
// one.
func (st *stream) firstSpeakerDecides(up net.Conn, handedOver *bool) error {
	sn := &sniffer{conn: st.conn}
	first := watchFirstRead(up, sn)
	client := io.Reader(st.r)
	switch sniff(st.r, sn, 0) {
	case sniffTLS:
		c, blind := st.tlsGoesBlind(true)
		if !blind {
			discard(up)
			<-first // the watcher ends with the close
			st.intercept(c, handedOver)
			return nil
		}
		client = c
	case sniffHTTP:
		discard(up)
		<-first
		st.intercept(readahead.Buffered(st.conn, st.r), handedOver)
		return nil
	}
	return st.splice(client, up, &firstReader{up: up, first: first})
}

// discarder is a tunnel that can be closed without being reported as one
// (the pipeline's access log): it was dialled for nothing.
type discarder interface{ Discard() error }

func discard(c net.Conn) {
	if d, ok := c.(discarder); ok {
		_ = d.Discard()
		return
	}
	c.Close()
}

// splice tunnels the client, read through fromClient (which replays what
// sniffing read), and up, read through fromUp.
func (st *stream) splice(fromClient io.Reader, up net.Conn, fromUp io.Reader) error {
	if err := Splice(st.s.ctx, st.conn, fromClient, up, fromUp); err != nil && st.s.ctx.Err() == nil {
		st.s.o.Logger.Debug("socks5: tunnel ended with an error", "target", st.t.Target, "client", st.t.Client, "err", err)
	}
	return nil
}

// intercept hands the stream to the pipeline as c, the client connection
// replaying every byte read ahead of it.
func (st *stream) intercept(c net.Conn, handedOver *bool) {
	*handedOver = true
	st.s.o.Pipeline.InterceptTunnel(c, st.t)
}

// replyCode maps a refused target or a failed upstream dial to a SOCKS5
// reply (RFC 1928 §6).
func replyCode(err error) uint8 {
	var (
		dnsErr *net.DNSError
		netErr net.Error
	)
	if st, ok := httpstatus.Of(err); ok && st >= 400 && st < 500 {
		return statute.RepRuleFailure // our policy said no (a forbidden target, a bad session hint)
	}
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return statute.RepConnectionRefused
	case errors.Is(err, syscall.ENETUNREACH):
		return statute.RepNetworkUnreachable
	case errors.Is(err, syscall.EHOSTUNREACH), errors.As(err, &dnsErr),
		errors.Is(err, context.DeadlineExceeded), errors.As(err, &netErr) && netErr.Timeout():
		return statute.RepHostUnreachable
	}
	// An upstream SOCKS5 proxy's refusal arrives as its reply's text
	// (golang.org/x/net/proxy: "unknown error connection refused"): pass
	// its meaning on.
	msg := err.Error()
	switch {
	case strings.Contains(msg, "connection refused"):
		return statute.RepConnectionRefused
	case strings.Contains(msg, "network unreachable"):
		return statute.RepNetworkUnreachable
	case strings.Contains(msg, "host unreachable"):
		return statute.RepHostUnreachable
	case strings.Contains(msg, "not allowed by ruleset"):
		return statute.RepRuleFailure
	}
	return statute.RepServerFailure
}

// sendReply writes a SOCKS5 reply. A success reports the SOCKS5 listener's
// address (the connection's local address), never the address the proxy
// leaves from; other replies carry 0.0.0.0:0.
func sendReply(w io.Writer, code uint8, bound net.Addr) error {
	addr := statute.AddrSpec{AddrType: statute.ATYPIPv4, IP: net.IPv4zero}
	if ta, ok := bound.(*net.TCPAddr); ok && code == statute.RepSuccess {
		if ip4 := ta.IP.To4(); ip4 != nil {
			addr.IP = ip4
		} else if ta.IP.To16() != nil {
			addr.AddrType, addr.IP = statute.ATYPIPv6, ta.IP.To16()
		}
		addr.Port = ta.Port
	}
	_, err := w.Write(statute.Reply{Version: statute.VersionSocks5, Response: code, BndAddr: addr}.Bytes())
	return err
}
