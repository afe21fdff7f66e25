package proxy

import (
	"context"
	"fmt"
	"net"
	"net/http"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
)

// The SOCKS5 door (package socks) reaches the pipeline through the three
// methods below: the same early check, blind tunnels and interception as a
// CONNECT on the HTTP port, without one.
var _ socks.Pipeline = (*Server)(nil)

// ServeSOCKS5 accepts SOCKS5 clients on ln until Shutdown, with cfg (its
// defaults applied) and the limits, users and bypass hosts of the HTTP
// port. It returns nil after a Shutdown, or the error that stopped it. It
// may run alongside Serve, and more than once on different listeners.
func (s *Server) ServeSOCKS5(ln net.Listener, cfg socks.Config) error {
	o := socks.Options{
		Logger:           s.logger,
		Pipeline:         s,
		Bypass:           s.bypass,
		MaxConns:         s.cfg.MaxConns,
		MaxPerClient:     s.cfg.MaxConnsPerClient,
		IdleTimeout:      s.cfg.IdleTimeout,
		HandshakeTimeout: s.cfg.ReadHeaderTimeout,
		AuthFailed:       s.metrics.AuthFailed,
	}
	if s.users != nil {
		o.Users = s.users
	}
	door, err := socks.New(cfg, o)
	if err != nil {
		ln.Close()
		return fmt.Errorf("proxy: %w", err)
	}
	s.doorsMu.Lock()
	if s.doorsClosed {
		s.doorsMu.Unlock()
		ln.Close()
		return nil
	}
	s.doors = append(s.doors, door)
	s.doorsMu.Unlock()
	return door.Serve(ln)
}

// CheckTunnel is the early check of a tunnel's target before anything is
// dialled or looked up: its syntax, then the SSRF guard (a refusal is the
// guard's error, with HTTPStatus 403). The returned context carries the
// client's identity and the guard's decision to the dial.
func (s *Server) CheckTunnel(ctx context.Context, t socks.Tunnel) (context.Context, error) {
	name, port, err := net.SplitHostPort(t.Target)
	if err == nil {
		err = checkConnectTarget(name, port)
	}
	if err != nil {
		return ctx, fmt.Errorf("bad target %q: %w", t.Target, err)
	}
	info, err := s.tunnelClient(t.User, t.Client, nil)
	if err != nil {
		return ctx, &badHintError{err}
	}
	ctx, err = s.guardHost(clientinfo.With(ctx, info), name)
	if err != nil {
		s.metrics.SSRFRefused()
	}
	return ctx, err
}

// DialTunnel opens the upstream side of a blind tunnel, through the
// upstream session t.User asks for, as for a bypass CONNECT. ctx is
// CheckTunnel's, or carries the client's identity (clientinfo.With) when
// the HTTP door's tunnel turned out not to be HTTP (tunnelBlind), which
// dials here too.
//
// A tunnel dialled upstream is one request for the rate limit, as a
// bypass CONNECT is (intercepted tunnels count request by request, and a
// stream to a port other than the MITM ones that turns out to be HTTP
// counts its dial too: the dial is upstream work).
func (s *Server) DialTunnel(ctx context.Context, t socks.Tunnel) (net.Conn, error) {
	info := clientinfo.From(ctx)
	name, _, _ := net.SplitHostPort(t.Target)
	if d, ok := s.allow(ctx, info.Client, name); !ok {
		return nil, rateLimitedError{d}
	}
	c, err := s.dialBlind(ctx, t.Target, info, t.Client)
	if err != nil {
		// A name that passed CheckTunnel but resolved to a forbidden
		// address (DNS rebinding) is refused at dial time: counted as the
		// same refusal is for a request or a bypass CONNECT (tunnelError).
		if _, kind := classify(err); kind == kindForbidden {
			s.metrics.SSRFRefused()
		}
		return nil, err
	}
	return c, nil
}

// InterceptTunnel serves c, a client stream of TLS or plain HTTP, as an
// intercepted CONNECT tunnel to t.Target of user t.User: the MITM for TLS,
// then the requests inside go through the same handler as the HTTP port's.
// It returns once the inner server has taken c over, and closes c when the
// server is shutting down.
func (s *Server) InterceptTunnel(c net.Conn, t socks.Tunnel) {
	// CheckTunnel refused a user whose hint cannot be parsed.
	info, _ := s.tunnelClient(t.User, t.Client, nil)
	s.intercept(c, &tunnel{
		info:       info,
		host:       t.Target,
		remoteAddr: t.Client,
	})
}

// badHintError is a session hint in a SOCKS5 user name the proxy cannot
// honour: the client's fault, refused like a policy (reply 0x02).
type badHintError struct{ err error }

func (e *badHintError) Error() string   { return "bad session hint: " + e.err.Error() }
func (e *badHintError) Unwrap() error   { return e.err }
func (e *badHintError) HTTPStatus() int { return http.StatusBadRequest }
