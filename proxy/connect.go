package proxy

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/elazarl/goproxy"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/halfclose"
	"github.com/seed-a3c387e8/onceproxy/internal/idleconn"
)

// handleConnect decides what happens to a CONNECT: a blind tunnel for bypass
// hosts, interception (TLS or plain HTTP inside the tunnel) for the rest.
// goproxy replies 200 itself for both.
func (s *Server) handleConnect(host string, pctx *goproxy.ProxyCtx) (*goproxy.ConnectAction, string) {
	// goproxy closes the client's connection after a refused CONNECT: the
	// answer says so, or a client that answers a 407 on the same
	// connection (curl --proxy-anyauth) finds it gone.
	reject := func(resp *http.Response) (*goproxy.ConnectAction, string) {
		resp.Close = true
		pctx.Resp = resp
		return goproxy.RejectConnect, host
	}
	name, port, err := net.SplitHostPort(host)
	if err == nil {
		err = checkConnectTarget(name, port)
	}
	// A CONNECT's target is host:port and nothing else (RFC 9112 §3.2.3).
	// net/http also parses a user, a path or a query out of it, and goproxy
	// hands over only the host: "CONNECT user@a:443/x" would be tunnelled
	// to a:443, the rest silently dropped.
	if rt := pctx.Req.RequestURI; err == nil && rt != "" && rt != host {
		err = fmt.Errorf("target %q is not authority-form (host:port, nothing else)", rt)
	}
	if err != nil {
		s.logger.Warn("refused CONNECT", "target", host, "client", pctx.Req.RemoteAddr, "err", err)
		return reject(errorResponse(pctx.Req, http.StatusBadRequest, kindBadRequest,
			fmt.Sprintf("bad CONNECT target %q: %v", host, err)))
	}
	user, refusal := s.authenticate(pctx.Req)
	if refusal != nil {
		return reject(refusal)
	}
	// Who the client is, decided once for the whole tunnel: its
	// requests carry this identity, whatever they say themselves. The
	// CONNECT's own X-Onceproxy-Session names the tunnel's session.
	info, err := s.tunnelClient(user, pctx.Req.RemoteAddr, pctx.Req.Header)
	if err != nil {
		s.logger.Warn("refused CONNECT with a bad session hint", "target", host, "client", pctx.Req.RemoteAddr, "err", err)
		return reject(badSession(pctx.Req, err))
	}
	if r := s.attribute(pctx.Req, info); r != nil {
		s.logger.Warn("refused CONNECT: the client holds its share of connections", "target", host, "client", info.Client)
		return reject(r)
	}
	if _, refused := s.checkTarget(pctx.Req.Context(), pctx.Req, name); refused != nil {
		s.logger.Warn("refused CONNECT to a forbidden target", "target", host, "client", pctx.Req.RemoteAddr)
		return reject(refused)
	}
	pctx.UserData = info // for hijackConnect
	if s.bypass.Match(name) {
		// A blind tunnel is one request as far as the rate limit goes;
		// intercepted tunnels are counted request by request.
		if r := s.limit(pctx.Req.Context(), pctx.Req, info.Client, name); r != nil {
			return reject(r)
		}
		return &goproxy.ConnectAction{Action: goproxy.ConnectAccept}, host
	}
	return s.mitmAction, host
}

// tunnelClient identifies the client of an authenticated tunnel: its proxy
// user, and the X-Onceproxy-Session and X-Onceproxy-Country headers of its
// CONNECT when it had them (h is nil on the SOCKS5 door).
func (s *Server) tunnelClient(user, remoteAddr string, h http.Header) (clientinfo.Info, error) {
	info, err := s.identify(user, remoteAddr, h)
	if err != nil || h == nil {
		return info, err
	}
	return hintHeaders(info, h)
}

func checkConnectTarget(name, port string) error {
	if name == "" {
		return fmt.Errorf("missing host")
	}
	if len(name) > 253 {
		return fmt.Errorf("host name longer than 253 bytes")
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c <= ' ' || c == 0x7f || c == '/' || c == '@' {
			return fmt.Errorf("invalid character %q in host", c)
		}
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 1 || p > 65535 {
		return fmt.Errorf("invalid port %q", port)
	}
	return nil
}

// dialTunnel is goproxy's dial for a bypass CONNECT, which handleConnect
// authenticated and checked: its user picks the upstream session
// (user-session-ID) like any request's would.
func (s *Server) dialTunnel(req *http.Request, network, addr string) (net.Conn, error) {
	info, err := s.tunnelClient(proxyUser(req.Header), req.RemoteAddr, req.Header)
	if err != nil {
		return nil, err
	}
	return s.dialBlind(context.Background(), addr, info, req.RemoteAddr)
}

// dialBlind opens the upstream side of a blind tunnel to addr for a client
// (who it is, from its proxy user and its CONNECT's headers or its SOCKS5
// user; its address), within the dial timeout. The client was
// authenticated before (handleConnect, CheckTunnel), which refused bad
// hints; here its identity picks the upstream session like any request's
// would. The guard runs again, on this context: the mark of an
// allow-listed name must reach the dial.
func (s *Server) dialBlind(ctx context.Context, addr string, info clientinfo.Info, remoteAddr string) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.DialTimeout)
	defer cancel()
	ctx = clientinfo.With(ctx, info)
	host, _, _ := net.SplitHostPort(addr)
	ctx, err := s.guardHost(ctx, host)
	if err != nil {
		return nil, err
	}
	c, err := s.upstream.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	s.metrics.Tunnel()
	// The tunnel's idle timeout (proxy.idle_timeout) on this side too: the
	// client's covers only what is read from or written to the client,
	// and once the client has half-closed (or hung up), the one read left
	// is the upstream's; a silent upstream would hold the tunnel and the
	// client's connection slot until upstream.idle_timeout, however
	// shorter the proxy's. Every byte either way keeps both sides alive.
	c = idleconn.Wrap(c, s.cfg.IdleTimeout)
	return &tunnelConn{Conn: halfclose.Conn{Conn: c}, start: time.Now(), addr: addr, client: remoteAddr, s: s}, nil
}

// tunnelError is goproxy's ConnectionErrHandler: when a bypass tunnel cannot
// be opened, the client gets a real HTTP error with the reason rather than a
// bare 502 or a closed socket.
func (s *Server) tunnelError(w io.Writer, pctx *goproxy.ProxyCtx, err error) {
	status, kind := classify(err)
	if kind == kindForbidden {
		s.metrics.SSRFRefused()
	}
	s.logger.Warn("tunnel failed", "target", pctx.Req.Host, "status", status, "kind", kind, "err", err)
	resp := errorResponse(pctx.Req, status, kind, err.Error())
	resp.Close = true
	_ = resp.Write(w)
}

// tunnelConn logs a blind tunnel when it ends, with the bytes each way.
type tunnelConn struct {
	halfclose.Conn
	start       time.Time
	addr        string
	client      string
	s           *Server
	read, wrote atomic.Int64
	closed      atomic.Bool
}

func (c *tunnelConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.read.Add(int64(n))
	return n, err
}

func (c *tunnelConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.wrote.Add(int64(n))
	return n, err
}

func (c *tunnelConn) Close() error {
	err := c.Conn.Close()
	if c.closed.CompareAndSwap(false, true) && c.s.accessLog {
		logAccess(context.Background(), c.s.logger, "tunnel", []slog.Attr{
			slog.String("target", c.addr), slog.String("client", c.client),
			slog.Int64("bytes_up", c.wrote.Load()), slog.Int64("bytes_down", c.read.Load()),
			slog.Duration("dur", time.Since(c.start))})
	}
	return err
}

// Discard closes a tunnel dialled for nothing (the SOCKS5 door found TLS
// or HTTP inside, and intercepts it instead), without an access log line.
func (c *tunnelConn) Discard() error {
	c.closed.Store(true)
	return c.Conn.Close()
}
