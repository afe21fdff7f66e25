package proxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/things-go/go-socks5"
	"github.com/things-go/go-socks5/statute"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
)

// UserStore verifies proxy users. Verify receives the user name exactly as
// the client sent it, session hints included ("acct-session-abc"); a store
// that knows accounts only can split it with clientinfo.ParseUser.
type UserStore interface {
	Verify(user, password string) bool
}

// socksDoor is the Server's SOCKS5 state: its listeners, the bridge into the
// http.Server, and the goroutines serving SOCKS5 clients, all stopped by
// Shutdown.
type socksDoor struct {
	ctx    context.Context // cancelled at the end of Shutdown: ends dials and waits
	cancel context.CancelFunc

	mu     sync.Mutex
	bridge *pushListener // nil until the first ServeSOCKS5
	lns    []*connListener
	closed bool           // Shutdown began: no new listeners or connection goroutines
	wg     sync.WaitGroup // connection goroutines and the bridge's Serve
}

func newSOCKSDoor() *socksDoor {
	ctx, cancel := context.WithCancel(context.Background())
	return &socksDoor{ctx: ctx, cancel: cancel}
}

// add registers a listener; false once Shutdown began.
func (d *socksDoor) add(cl *connListener) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return false
	}
	d.lns = append(d.lns, cl)
	return true
}

// goServe runs f in a goroutine Shutdown waits for; false once Shutdown
// began (the WaitGroup must not grow while Shutdown waits on it).
func (d *socksDoor) goServe(f func()) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return false
	}
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		f()
	}()
	return true
}

// stopAccepting closes the SOCKS5 listeners: the first step of Shutdown,
// alongside the HTTP listener.
func (d *socksDoor) stopAccepting() {
	d.mu.Lock()
	d.closed = true
	lns := d.lns
	d.mu.Unlock()
	for _, cl := range lns {
		cl.Close()
	}
}

// cut closes every SOCKS5 connection and waits for their goroutines: the
// last step of Shutdown, after the grace period. It does not wait forever:
// with their connections closed and their context cancelled the goroutines
// end within moments, and a shutdown that hangs is worse than a report.
func (d *socksDoor) cut(logger *slog.Logger) {
	d.mu.Lock()
	d.closed = true
	lns, bridge := d.lns, d.bridge
	d.mu.Unlock()
	for _, cl := range lns {
		cl.closeAll()
	}
	d.cancel()
	if bridge != nil {
		bridge.Close() // http.Server.Shutdown did already, unless it never served it
	}
	done := make(chan struct{})
	go func() {
		d.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		logger.Error("socks5: connection goroutines still running 5s after their connections were cut")
	}
}

// ServeSOCKS5 accepts SOCKS5 clients on ln until Shutdown, with cfg (its
// defaults applied). It returns nil after a Shutdown, or the error that
// stopped it. It may run alongside Serve, and more than once on different
// listeners.
//
// A SOCKS5 CONNECT gets exactly what an HTTP proxy client gets: TLS and
// HTTP inside the stream go through the MITM into the same handler (dedup,
// cache, sessions); bypass hosts and other protocols are tunnelled through
// the upstream byte for byte. UDP ASSOCIATE and BIND are refused.
func (s *Server) ServeSOCKS5(ln net.Listener, cfg SOCKS5Config) error {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		ln.Close()
		return fmt.Errorf("proxy: socks5: %w", err)
	}
	cl := newConnListener(ln, s.cfg.MaxConns, s.cfg.IdleTimeout)
	if !s.socks.add(cl) {
		cl.Close()
		return nil
	}
	bridge := s.startBridge(ln.Addr())
	srv := s.newSOCKS5Server(cfg, bridge)
	s.logger.Info("socks5 listening", "addr", ln.Addr().String(), "auth", s.socksAuthMode(cfg))
	if s.users == nil && !cfg.AllowNoAuth {
		s.logger.Error("socks5: no user store is configured and socks5.allow_no_auth is false: " +
			"every SOCKS5 client will be refused (set socks5.allow_no_auth, or configure users)")
	}
	if ta, ok := ln.Addr().(*net.TCPAddr); ok && !ta.IP.IsLoopback() && s.users == nil && cfg.AllowNoAuth {
		s.logger.Warn("socks5: the port is reachable beyond loopback and lets anyone in (allow_no_auth, no user store)",
			"addr", ta.String())
	}

	var delay time.Duration
	for {
		c, err := cl.Accept()
		if err != nil {
			if s.socksClosed() {
				return nil
			}
			if errors.Is(err, net.ErrClosed) {
				return fmt.Errorf("proxy: socks5: accept: %w", err)
			}
			// Out of file descriptors and the like: back off as
			// http.Server does, rather than spin or give up.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			s.logger.Warn("socks5: accept failed; retrying", "err", err, "in", delay)
			select {
			case <-time.After(delay):
			case <-s.socks.ctx.Done():
			}
			continue
		}
		delay = 0
		if !s.socks.goServe(func() { s.serveSOCKS5Conn(srv, c, cfg) }) {
			c.Close()
			return nil
		}
	}
}

func (s *Server) socksClosed() bool {
	s.socks.mu.Lock()
	defer s.socks.mu.Unlock()
	return s.socks.closed
}

func (s *Server) socksAuthMode(cfg SOCKS5Config) string {
	switch {
	case s.users != nil:
		return "username/password"
	case cfg.AllowNoAuth:
		return "none (user names unverified)"
	default:
		return "refuse all"
	}
}

// startBridge returns the bridge into the Server's own http.Server,
// serving it on first use. http.Server.Shutdown closes it like the HTTP
// listener, which ends the serving goroutine.
func (s *Server) startBridge(addr net.Addr) *pushListener {
	d := s.socks
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.bridge != nil {
		return d.bridge
	}
	b := newPushListener(addr)
	d.bridge = b
	if !d.closed {
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			if err := s.srv.Serve(b); err != nil && !errors.Is(err, http.ErrServerClosed) {
				s.logger.Error("socks5: bridge into the HTTP pipeline stopped", "err", err)
			}
		}()
	}
	return b
}

// newSOCKS5Server configures go-socks5 for one listener.
func (s *Server) newSOCKS5Server(cfg SOCKS5Config, bridge *pushListener) *socks5.Server {
	var auth []socks5.Authenticator
	switch {
	case s.users != nil:
		// Offer user/password only: a client that cannot authenticate
		// gets "no acceptable methods" (0xFF).
		auth = []socks5.Authenticator{socks5.UserPassAuthenticator{Credentials: credentials{users: s.users}}}
	case cfg.AllowNoAuth:
		// User/password first: the server picks the first of its methods
		// the client offers, and a client that offers both (curl with
		// user:pass does) must get to send its user name, which carries
		// the session hints.
		auth = []socks5.Authenticator{
			socks5.UserPassAuthenticator{Credentials: credentials{}},
			socks5.NoAuthAuthenticator{},
		}
	default:
		// go-socks5 falls back to no-auth when given no method; this one
		// matches nothing a client should offer, and refuses if it does.
		auth = []socks5.Authenticator{refuseAll{}}
	}
	refuse := func(_ context.Context, w io.Writer, r *socks5.Request) error {
		// UDP could not leave through the upstream sessions and would
		// expose the host's own address; BIND has no use here.
		_ = sendReply(w, statute.RepCommandNotSupported, nil)
		return fmt.Errorf("%w: command %d", errCommandRefused, r.Command)
	}
	return socks5.NewServer(
		socks5.WithAuthMethods(auth),
		// Keep host names as sent (socks5h): the default resolver looks
		// the name up locally, and the request would then carry the IP.
		socks5.WithResolver(keepName{}),
		// Every command reaches a handler of ours. Filtering with
		// PermitCommand{EnableConnect: true} instead would answer BIND and
		// UDP ASSOCIATE with 0x02 (not allowed by ruleset), where RFC 1928
		// has 0x07 (command not supported).
		socks5.WithRule(socks5.NewPermitAll()),
		socks5.WithConnectHandle(func(_ context.Context, w io.Writer, r *socks5.Request) error {
			return s.socksConnect(w, r, cfg, bridge)
		}),
		socks5.WithBindHandle(refuse),
		socks5.WithAssociateHandle(refuse),
		socks5.WithLogger(socksLogger{s.logger}),
	)
}

var errCommandRefused = errors.New("command not supported: only CONNECT is")

// serveSOCKS5Conn serves one SOCKS5 client connection; it closes c.
func (s *Server) serveSOCKS5Conn(srv *socks5.Server, c net.Conn, cfg SOCKS5Config) {
	defer c.Close()
	// The greeting, authentication and request must arrive within the
	// header timeout of the HTTP port; socksConnect lifts the deadline.
	_ = c.SetDeadline(time.Now().Add(s.cfg.ReadHeaderTimeout))
	client := c.RemoteAddr().String()
	var ver [1]byte
	if _, err := io.ReadFull(c, ver[:]); err != nil {
		return
	}
	if ver[0] != statute.VersionSocks5 {
		// go-socks5 would read as many method bytes as the garbage
		// claims before checking the version: answer now instead.
		s.notSOCKS5(c, ver[0])
		return
	}
	err := srv.ServeConn(&prefixConn{Conn: c, prefix: ver[:]})
	switch {
	case err == nil:
	case errors.Is(err, statute.ErrUserAuthFailed):
		s.logger.Warn("socks5: authentication failed", "client", client)
	case errors.Is(err, statute.ErrNoSupportedAuth), errors.Is(err, errNoAuthConfigured):
		reason := "client offers no acceptable authentication method"
		if s.users == nil && !cfg.AllowNoAuth {
			reason = "no user store is configured and socks5.allow_no_auth is false"
		}
		s.logger.Warn("socks5: client refused", "client", client, "reason", reason)
	case errors.Is(err, errCommandRefused):
		s.logger.Info("socks5: refused a command other than CONNECT", "client", client, "err", err)
	case s.socks.ctx.Err() != nil, errors.Is(err, io.EOF), errors.Is(err, net.ErrClosed):
		s.logger.Debug("socks5: connection ended", "client", client, "err", err)
	default:
		// Malformed requests and clients that hang up mid-handshake.
		s.logger.Info("socks5: connection failed", "client", client, "err", err)
	}
}

// notSOCKS5 answers a client that does not speak SOCKS5 as usefully as its
// first byte allows, then the caller closes.
func (s *Server) notSOCKS5(c net.Conn, first byte) {
	s.logger.Info("socks5: not a SOCKS5 client; closing", "client", c.RemoteAddr().String(), "first_byte", fmt.Sprintf("%#02x", first))
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

// socksConnect handles one CONNECT. It returns when the stream is over;
// go-socks5 then closes the client connection.
func (s *Server) socksConnect(w io.Writer, req *socks5.Request, cfg SOCKS5Config, bridge *pushListener) error {
	conn, ok := w.(net.Conn)
	if !ok {
		return fmt.Errorf("socks5: internal: client is a %T, not a net.Conn", w)
	}
	_ = conn.SetDeadline(time.Time{}) // handshake over; the idle deadline remains

	host := req.DestAddr.FQDN
	if host == "" && len(req.DestAddr.IP) > 0 {
		host = req.DestAddr.IP.String()
	}
	port := strconv.Itoa(req.DestAddr.Port)
	if err := checkConnectTarget(host, port); err != nil {
		_ = sendReply(conn, statute.RepServerFailure, nil)
		return fmt.Errorf("socks5: bad CONNECT target %q: %w", host, err)
	}
	t := &socksTunnel{
		s:      s,
		cfg:    cfg,
		bridge: bridge,
		conn:   conn,
		target: net.JoinHostPort(host, port),
		client: conn.RemoteAddr().String(),
	}
	if r, ok := req.Reader.(*bufio.Reader); ok {
		t.r = r
	} else {
		t.r = bufio.NewReader(req.Reader)
	}
	if ac := req.AuthContext; ac != nil && ac.Method == statute.MethodUserPassAuth {
		t.user, t.password, t.hasCreds = ac.Payload["username"], ac.Payload["password"], true
	}

	info, err := s.identify(t.user, t.client, nil)
	if err != nil {
		s.logger.Warn("socks5: refused a CONNECT with a bad session hint", "target", t.target, "client", t.client, "err", err)
		_ = sendReply(conn, statute.RepRuleFailure, nil)
		return nil
	}
	t.info = info
	bypass := s.bypass.Match(host)
	if cfg.isMITMPort(req.DestAddr.Port) && !bypass {
		return t.sniffFirst()
	}
	return t.dialFirst(bypass)
}

// socksTunnel is one SOCKS5 CONNECT on its way to the pipeline or upstream.
type socksTunnel struct {
	s        *Server
	cfg      SOCKS5Config
	bridge   *pushListener
	conn     net.Conn      // the client
	r        *bufio.Reader // reads conn, with what the SOCKS5 parser buffered
	target   string        // host:port, the host name as the client sent it
	client   string
	user     string
	password string
	hasCreds bool
	info     clientinfo.Info // who the client is (identify)
}

// sniffFirst serves a CONNECT to a MITM port: the usual case (HTTPS, HTTP)
// is answered at once and intercepted without dialling anything; a stream
// that is neither is tunnelled after the fact. A client still silent after
// sniff_timeout may be waiting for a server-speaks-first greeting: the
// upstream is dialled, and whichever side speaks first decides (a slow
// TLS client is still intercepted). A failed dial can only close the
// connection: the SOCKS5 reply is sent.
func (t *socksTunnel) sniffFirst() error {
	if err := sendReply(t.conn, statute.RepSuccess, t.conn.LocalAddr()); err != nil {
		return fmt.Errorf("socks5: reply: %w", err)
	}
	kind := sniff(t.r, &sniffer{conn: t.conn}, t.cfg.SniffTimeout)
	switch kind {
	case sniffTLS, sniffHTTP:
		return t.intercept()
	case sniffClosed:
		return nil
	}
	up, err := t.dial()
	if err != nil {
		t.s.logger.Warn("socks5: tunnel failed after the reply; closing", "target", t.target,
			"client", t.client, "sniffed", kind.String(), "err", err)
		return nil
	}
	if kind == sniffOther {
		return t.splice(up, up)
	}
	return t.firstSpeakerDecides(up)
}

// dialFirst serves a CONNECT to any other port, or to a bypass host: dial
// the upstream first, so that a failure becomes a SOCKS5 reply code, then
// tunnel. A stream to another port that turns out to be TLS or HTTP is
// still intercepted, at the cost of the dial made for nothing.
func (t *socksTunnel) dialFirst(bypass bool) error {
	up, err := t.dial()
	if err != nil {
		code := socksReplyCode(err)
		t.s.logger.Warn("socks5: tunnel failed", "target", t.target, "client", t.client,
			"reply", code, "err", err)
		_ = sendReply(t.conn, code, nil)
		return nil
	}
	if err := sendReply(t.conn, statute.RepSuccess, t.conn.LocalAddr()); err != nil {
		up.Close()
		return fmt.Errorf("socks5: reply: %w", err)
	}
	if bypass {
		return t.splice(up, up)
	}
	return t.firstSpeakerDecides(up)
}

// firstSpeakerDecides sniffs the client while the dialled upstream may
// already be talking. If the client speaks first, its bytes decide (TLS or
// HTTP: intercept; else tunnel); if the upstream does (a server-speaks-first
// protocol), the stream is tunnelled at once. No timeout but the idle one:
// until somebody speaks there is nothing to forward, so waiting costs no
// latency, and a client slowed down by load is never mistaken for a silent
// one.
func (t *socksTunnel) firstSpeakerDecides(up net.Conn) error {
	sn := &sniffer{conn: t.conn}
	first := watchFirstRead(up, sn)
	switch sniff(t.r, sn, 0) {
	case sniffTLS, sniffHTTP:
		discard(up)
		<-first // the watcher ends with the close
		return t.intercept()
	default:
		return t.splice(up, &firstReader{up: up, first: first})
	}
}

// dial opens the upstream side of a blind tunnel. The context carries the
// client's identity as for a request, so that an upstream with sessions
// tunnels through the one the user name asks for.
func (t *socksTunnel) dial() (net.Conn, error) {
	ctx, cancel := context.WithTimeout(t.s.socks.ctx, t.s.cfg.DialTimeout)
	defer cancel()
	ctx = clientinfo.With(ctx, t.info)
	c, err := t.s.upstream.DialContext(ctx, "tcp", t.target)
	if err != nil {
		return nil, err
	}
	return &tunnelConn{Conn: c, start: time.Now(), addr: t.target, client: t.client, s: t.s}, nil
}

// discard closes a tunnel dialled for nothing, without an access log line.
func discard(c net.Conn) {
	if tc, ok := c.(*tunnelConn); ok {
		tc.closed.Store(true)
	}
	c.Close()
}

func (t *socksTunnel) splice(up net.Conn, fromUp io.Reader) error {
	if err := splice(t.s.socks.ctx, t.conn, t.r, up, fromUp); err != nil && t.s.socks.ctx.Err() == nil {
		t.s.logger.Debug("socks5: tunnel ended with an error", "target", t.target, "client", t.client, "err", err)
	}
	return nil
}

// intercept hands the stream to goproxy through the bridge and waits until
// goproxy is done with it.
func (t *socksTunnel) intercept() error {
	bc := newBridgeConn(t.conn, connectPreamble(t.target, t.user, t.password, t.hasCreds),
		t.r, t.target, t.s.logger)
	if err := t.bridge.push(bc, t.s.socks.ctx.Done()); err != nil {
		return fmt.Errorf("socks5: hand %s to the pipeline: %w", t.target, err)
	}
	select {
	case <-bc.done:
	case <-t.s.socks.ctx.Done():
	}
	return nil
}

// socksReplyCode maps a failed upstream dial to a SOCKS5 reply (RFC 1928 §6).
func socksReplyCode(err error) uint8 {
	var (
		withStatus interface{ HTTPStatus() int }
		dnsErr     *net.DNSError
		netErr     net.Error
	)
	switch {
	case errors.As(err, &withStatus) && withStatus.HTTPStatus() == http.StatusForbidden:
		return statute.RepRuleFailure // our policy said no
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

// sendReply writes a SOCKS5 reply. Unlike socks5.SendReply it never turns
// a success into "address type not supported" when the bound address is not
// a *net.TCPAddr; it reports the SOCKS5 listener's address, not the
// address the proxy leaves from.
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

// credentials adapts a UserStore to go-socks5; with no store it accepts
// anyone (socks5.allow_no_auth). A user name with a colon is refused
// either way: it could not travel in the Basic Proxy-Authorization that
// carries it into the pipeline (RFC 7617 forbids it there).
type credentials struct{ users UserStore }

func (c credentials) Valid(user, password, _ string) bool {
	if strings.Contains(user, ":") {
		return false
	}
	return c.users == nil || c.users.Verify(user, password)
}

var errNoAuthConfigured = errors.New("socks5: no authentication method is allowed")

// refuseAll is the only method when nothing is allowed: its code is "no
// acceptable methods", so a client matches it only by offering 0xFF itself.
type refuseAll struct{}

func (refuseAll) GetCode() uint8 { return statute.MethodNoAcceptable }

func (refuseAll) Authenticate(_ io.Reader, w io.Writer, _ string) (*socks5.AuthContext, error) {
	_, _ = w.Write([]byte{statute.VersionSocks5, statute.MethodNoAcceptable})
	return nil, errNoAuthConfigured
}

// keepName is a resolver that resolves nothing: the host name goes to the
// policy, the pipeline and the upstream as the client sent it.
type keepName struct{}

func (keepName) Resolve(ctx context.Context, _ string) (context.Context, net.IP, error) {
	return ctx, nil, nil
}

// socksLogger sends go-socks5's own messages to slog at debug level.
type socksLogger struct{ l *slog.Logger }

func (g socksLogger) Errorf(format string, args ...any) {
	g.l.Debug("go-socks5: " + fmt.Sprintf(format, args...))
}
