package socks

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/things-go/go-socks5"
	"github.com/things-go/go-socks5/statute"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/connlimit"
	"github.com/seed-a3c387e8/onceproxy/internal/hostmatch"
	"github.com/seed-a3c387e8/onceproxy/internal/workers"
)

// Pipeline is what lies behind the door. *proxy.Server satisfies it.
type Pipeline interface {
	// CheckTunnel is the early check of a CONNECT's target: its syntax,
	// then the policy (the SSRF guard), before anything is dialled or
	// looked up. A refusal by the policy has an HTTPStatus() of 403. The
	// context it returns carries the decision to DialTunnel.
	CheckTunnel(ctx context.Context, t Tunnel) (context.Context, error)
	// DialTunnel opens the upstream side of a blind tunnel to t.Target,
	// through the upstream session t.User asks for.
	DialTunnel(ctx context.Context, t Tunnel) (net.Conn, error)
	// InterceptTunnel takes c over: a client stream that starts with TLS
	// or HTTP (bytes read ahead included), past the SOCKS5 reply. It is
	// served like an intercepted CONNECT tunnel, and closed when done.
	InterceptTunnel(c net.Conn, t Tunnel)
}

// Tunnel is what the door knows about one CONNECT.
type Tunnel struct {
	// Target is host:port, the host as the client sent it: a name stays a
	// name (socks5h), for the policy and the upstream to see.
	Target string
	// User is the RFC 1929 user name, session hints included
	// ("acct-session-ID"); "" without user/password authentication.
	User string
	// Client is the client's address.
	Client string
}

// UserStore verifies RFC 1929 user names and passwords. Verify receives
// the client (clientinfo.ClientOf its address) and the user name exactly
// as the client sent it, session hints included. A refusal with a
// retryAfter (too many failures from the client) is a refusal here: RFC
// 1929 has no way to say more.
type UserStore interface {
	Verify(client, user, password string) (ok bool, retryAfter time.Duration)
}

// Options are the parts a Server is wired from.
type Options struct {
	// Logger receives the door's log lines. Required.
	Logger *slog.Logger
	// Pipeline takes the streams. Required.
	Pipeline Pipeline
	// Users verifies clients; nil means no user store, and
	// Config.AllowNoAuth decides who gets in.
	Users UserStore
	// Bypass are the hosts never intercepted, whatever they speak
	// (proxy.bypass_hosts); nil bypasses nothing.
	Bypass *hostmatch.Set
	// MaxConns caps the live client connections of each listener
	// (proxy.max_conns). Required.
	MaxConns int
	// MaxPerClient caps the live connections from one client address
	// (proxy.max_conns_per_client); 0 means none.
	MaxPerClient int
	// IdleTimeout closes a connection or tunnel on which nothing moved for
	// this long (proxy.idle_timeout); 0 means none.
	IdleTimeout time.Duration
	// HandshakeTimeout bounds the greeting, authentication and request
	// (proxy.read_header_timeout). Required.
	HandshakeTimeout time.Duration
	// AuthFailed, if set, hears of each client the user store refused: a
	// wrong login, or no offer of user/password at all (the HTTP port's
	// 407), for onceproxy_auth_failures_total.
	AuthFailed func()
}

// Server is the SOCKS5 door. Create it with New, run it with Serve, stop
// it with Shutdown or Close.
type Server struct {
	cfg    Config
	o      Options
	ctx    context.Context // cancelled by Close: ends dials and tunnels
	cancel context.CancelFunc

	mu     sync.Mutex
	lns    []*connlimit.Listener
	closed bool           // Shutdown or Close began: no new listeners or connection goroutines
	wg     sync.WaitGroup // connection goroutines
}

// New builds a Server; cfg gets its defaults applied.
func New(cfg Config, o Options) (*Server, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("socks5: %w", err)
	}
	if o.Logger == nil || o.Pipeline == nil || o.MaxConns < 1 || o.HandshakeTimeout <= 0 {
		return nil, errors.New("socks5: Logger, Pipeline, MaxConns and HandshakeTimeout are required")
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Server{cfg: cfg, o: o, ctx: ctx, cancel: cancel}, nil
}

// Serve accepts SOCKS5 clients on ln until Shutdown or Close. It returns
// nil after those, or the error that stopped it. It may run more than once
// on different listeners, each with a connection cap of its own.
func (s *Server) Serve(ln net.Listener) error {
	cl := connlimit.New(ln, connlimit.Config{MaxConns: s.o.MaxConns, IdleTimeout: s.o.IdleTimeout,
		MaxPerClient: s.o.MaxPerClient, RefuseInProtocol: true})
	if !s.add(cl) {
		cl.Close()
		return nil
	}
	s.o.Logger.Info("socks5 listening", "addr", ln.Addr().String(), "auth", s.authMode())
	if s.o.Users == nil && !s.cfg.AllowNoAuth {
		s.o.Logger.Error("socks5: no user store is configured and socks5.allow_no_auth is false: " +
			"every SOCKS5 client will be refused (set socks5.allow_no_auth, or configure users)")
	}
	if ta, ok := ln.Addr().(*net.TCPAddr); ok && !ta.IP.IsLoopback() && s.o.Users == nil && s.cfg.AllowNoAuth {
		s.o.Logger.Warn("socks5: the port is reachable beyond loopback and lets anyone in (allow_no_auth, no user store)",
			"addr", ta.String())
	}

	// Out of file descriptors and the like: anything but the listener
	// closed.
	passes := func(err error) bool { return !s.isClosed() && !errors.Is(err, net.ErrClosed) }
	for {
		c, err := connlimit.AcceptRetrying(s.ctx, cl, s.o.Logger, "socks5", passes)
		if err != nil {
			if s.isClosed() {
				return nil
			}
			return fmt.Errorf("socks5: accept: %w", err)
		}
		if !s.goServe(func() { s.serveConn(c) }) {
			c.Close()
			return nil
		}
	}
}

// ConnStats sums the client connection counts of the door's listeners.
func (s *Server) ConnStats() connlimit.Stats {
	s.mu.Lock()
	lns := s.lns
	s.mu.Unlock()
	var st connlimit.Stats
	for _, cl := range lns {
		st = st.Add(cl.Stats())
	}
	return st
}

// add registers a listener; false once Shutdown or Close began.
func (s *Server) add(cl *connlimit.Listener) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.lns = append(s.lns, cl)
	return true
}

// goServe runs f in a goroutine Close waits for; false once Shutdown or
// Close began (the WaitGroup must not grow while Close waits on it).
func (s *Server) goServe(f func()) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		f()
	}()
	return true
}

func (s *Server) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// stopAccepting closes the listeners and returns them.
func (s *Server) stopAccepting() []*connlimit.Listener {
	s.mu.Lock()
	s.closed = true
	lns := s.lns
	s.mu.Unlock()
	for _, cl := range lns {
		cl.Close()
	}
	return lns
}

// Shutdown stops accepting clients at once, waits until every client
// connection of the door has ended (intercepted streams included, which
// the pipeline closes when done) or ctx ends, then closes what is left as
// Close does. It returns ctx's error when it had to cut connections.
func (s *Server) Shutdown(ctx context.Context) error {
	lns := s.stopAccepting()
	live := func() int {
		n := 0
		for _, cl := range lns {
			n += cl.Len()
		}
		return n
	}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for live() > 0 && ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case <-tick.C:
		}
	}
	var err error
	if live() > 0 {
		err = ctx.Err()
	}
	s.Close()
	return err
}

// Close stops accepting, cuts every client connection and tunnel, and
// waits for the door's goroutines. It does not wait forever: with their
// connections closed and their context cancelled they end within moments,
// and a shutdown that hangs is worse than a report.
func (s *Server) Close() error {
	for _, cl := range s.stopAccepting() {
		cl.CloseAll()
	}
	s.cancel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if workers.Wait(ctx, &s.wg) != nil {
		s.o.Logger.Error("socks5: connection goroutines still running 5s after their connections were cut")
	}
	return nil
}

func (s *Server) authMode() string {
	switch {
	case s.o.Users != nil:
		return "username/password"
	case s.cfg.AllowNoAuth:
		return "none (user names unverified)"
	default:
		return "refuse all"
	}
}

var (
	errCommandRefused   = errors.New("command not supported: only CONNECT is")
	errNoAuthConfigured = errors.New("no authentication method is allowed")
)

// serveConn serves one client connection. It closes c, unless the stream
// was handed over to be intercepted.
func (s *Server) serveConn(c net.Conn) {
	handedOver := false
	defer func() {
		if !handedOver {
			c.Close()
		}
	}()
	client := c.RemoteAddr().String()
	err := s.handshake(c, &handedOver)
	switch {
	case err == nil:
	case errors.Is(err, statute.ErrUserAuthFailed):
		s.authFailed()
		s.o.Logger.Warn("socks5: authentication failed", "client", client)
	case errors.Is(err, statute.ErrNoSupportedAuth), errors.Is(err, errNoAuthConfigured):
		reason := "client offers no acceptable authentication method"
		if s.o.Users != nil {
			s.authFailed()
		} else if !s.cfg.AllowNoAuth {
			reason = "no user store is configured and socks5.allow_no_auth is false"
		}
		s.o.Logger.Warn("socks5: client refused", "client", client, "reason", reason)
	case errors.Is(err, connlimit.ErrTooManyConns):
		s.o.Logger.Warn("socks5: client refused", "client", client, "reason", err.Error())
	case errors.Is(err, errCommandRefused):
		s.o.Logger.Info("socks5: refused a command other than CONNECT", "client", client, "err", err)
	case s.ctx.Err() != nil, errors.Is(err, io.EOF), errors.Is(err, net.ErrClosed):
		s.o.Logger.Debug("socks5: connection ended", "client", client, "err", err)
	default:
		// Malformed requests and clients that hang up mid-handshake.
		s.o.Logger.Info("socks5: connection failed", "client", client, "err", err)
	}
}

// authFailed counts a client the user store refused, if anyone listens.
func (s *Server) authFailed() {
	if s.o.AuthFailed != nil {
		s.o.AuthFailed()
	}
}

// handshake reads the greeting, authenticates, reads the request and
// serves it; it returns when the stream is over or handed over.
func (s *Server) handshake(c net.Conn, handedOver *bool) error {
	// The greeting, authentication and request must arrive within the
	// header timeout of the HTTP port; the CONNECT lifts the deadline.
	_ = c.SetDeadline(time.Now().Add(s.o.HandshakeTimeout))
	br := bufio.NewReader(c)
	ver, err := br.Peek(1)
	if err != nil {
		return fmt.Errorf("read greeting: %w", err)
	}
	if ver[0] != statute.VersionSocks5 {
		s.notSOCKS5(c, ver[0])
		return nil
	}
	mr, err := statute.ParseMethodRequest(br)
	if err != nil {
		return fmt.Errorf("read greeting: %w", err)
	}
	if n := connlimit.OverCap(c); n > 0 {
		// Its client holds its share of the port's connections: refused
		// in SOCKS5, as the answer to the greeting it sent.
		_, _ = c.Write([]byte{statute.VersionSocks5, statute.MethodNoAcceptable})
		return fmt.Errorf("%w (proxy.max_conns_per_client = %d)", connlimit.ErrTooManyConns, n)
	}
	ac, err := s.authenticate(br, c, mr.Methods)
	if err != nil {
		return err
	}
	req, err := statute.ParseRequest(br)
	if err != nil {
		switch {
		case errors.Is(err, statute.ErrUnrecognizedAddrType):
			_ = sendReply(c, statute.RepAddrTypeNotSupported, nil)
		case malformed(err):
			// A request that is not SOCKS5 (another version) gets
			// SOCKS5's general failure, not a silent close.
			_ = sendReply(c, statute.RepServerFailure, nil)
		}
		return fmt.Errorf("read request: %w", err)
	}
	if req.Command != statute.CommandConnect {
		_ = sendReply(c, statute.RepCommandNotSupported, nil)
		return fmt.Errorf("%w: command %d", errCommandRefused, req.Command)
	}
	_ = c.SetDeadline(time.Time{}) // handshake over; the idle deadline remains

	t := Tunnel{Client: c.RemoteAddr().String()}
	if ac.Method == statute.MethodUserPassAuth {
		t.User = ac.Payload["username"]
	}
	host := req.DstAddr.FQDN
	if host == "" && len(req.DstAddr.IP) > 0 {
		host = req.DstAddr.IP.String()
	}
	t.Target = net.JoinHostPort(host, strconv.Itoa(req.DstAddr.Port))
	st := &stream{s: s, conn: c, r: br, t: t, host: host, port: req.DstAddr.Port}
	return st.serve(handedOver)
}

// authenticate picks the first of the door's methods the client offers
// (RFC 1928 §3) and runs it. With no user store and no allow_no_auth the
// door has no method: every client gets "no acceptable methods" (0xFF).
func (s *Server) authenticate(r io.Reader, w net.Conn, offered []byte) (*socks5.AuthContext, error) {
	var methods []socks5.Authenticator
	switch {
	case s.o.Users != nil:
		// User/password only: a client that cannot authenticate gets
		// "no acceptable methods".
		methods = []socks5.Authenticator{socks5.UserPassAuthenticator{Credentials: credentials{users: s.o.Users}}}
	case s.cfg.AllowNoAuth:
		// User/password first: a client that offers both (curl with
		// user:pass does) must get to send its user name, which carries
		// the session hints.
		methods = []socks5.Authenticator{
			socks5.UserPassAuthenticator{Credentials: credentials{}},
			socks5.NoAuthAuthenticator{},
		}
	}
	for _, m := range methods {
		for _, code := range offered {
			if m.GetCode() == code {
				// The client's address: the user store limits the
				// failed logins of each client (auth.max_failures_per_minute).
				ac, err := m.Authenticate(r, w, w.RemoteAddr().String())
				if err != nil && m.GetCode() == statute.MethodUserPassAuth && malformed(err) &&
					!errors.Is(err, statute.ErrUserAuthFailed) {
					// A sub-negotiation that is not RFC 1929's (another
					// version): its failure status before the close,
					// as for a wrong password.
					_, _ = w.Write([]byte{statute.UserPassAuthVersion, statute.AuthFailure})
				}
				return ac, err
			}
		}
	}
	_, _ = w.Write([]byte{statute.VersionSocks5, statute.MethodNoAcceptable})
	if methods == nil {
		return nil, errNoAuthConfigured
	}
	return nil, statute.ErrNoSupportedAuth
}

// malformed reports whether err, from parsing what a client sent, says
// the bytes were wrong rather than that they stopped coming (the client
// left, the deadline passed): those get a failure reply.
func malformed(err error) bool {
	var ne net.Error
	return !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) &&
		!errors.Is(err, net.ErrClosed) && !errors.As(err, &ne)
}

// notSOCKS5 answers a client that does not speak SOCKS5 as usefully as its
// first byte allows, then the caller closes.
func (s *Server) notSOCKS5(c net.Conn, first byte) {
	s.o.Logger.Info("socks5: not a SOCKS5 client; closing", "client", c.RemoteAddr().String(), "first_byte", fmt.Sprintf("%#02x", first))
	switch {
	case first == 0x04:
		// SOCKS4: "request rejected or failed".
		_, _ = c.Write([]byte{0x00, 0x5b, 0, 0, 0, 0, 0, 0})
	case first >= 'A' && first <= 'Z':
		// An HTTP client pointed at the wrong port.
		const body = "onceproxy: this is the SOCKS5 port; send HTTP proxy requests to the HTTP proxy port\n"
		_, _ = io.WriteString(c, "HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"+
			"Connection: close\r\nContent-Length: "+strconv.Itoa(len(body))+"\r\n\r\n"+body)
	}
}

// credentials adapts a UserStore to go-socks5; with no store it accepts
// anyone (socks5.allow_no_auth). A user name with a colon is refused
// either way: Basic credentials, which carry user names on the HTTP port,
// end the name at the first colon (RFC 7617), so no user of this proxy can
// have one, and both doors accept the same names.
type credentials struct{ users UserStore }

func (c credentials) Valid(user, password, userAddr string) bool {
	if strings.Contains(user, ":") {
		return false
	}
	if c.users == nil {
		return true
	}
	ok, _ := c.users.Verify(clientinfo.ClientOf("", userAddr), user, password)
	return ok
}
