// Package proxy is onceproxy's front door: the HTTP proxy port (absolute-form
// requests and CONNECT, on goproxy), interception of CONNECT tunnels with the
// local CA, and the one handler every request goes through on its way to the
// next stage (the dedup engine, then the upstream). The SOCKS5 port is a
// door of its own (package socks), which the Server runs (ServeSOCKS5) and
// serves as its socks.Pipeline: the same early target check, blind tunnels
// and interception as a CONNECT here.
package proxy

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/elazarl/goproxy"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/connlimit"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/capture"
	"github.com/seed-a3c387e8/onceproxy/internal/hostmatch"
	"github.com/seed-a3c387e8/onceproxy/internal/metrics"
	"github.com/seed-a3c387e8/onceproxy/internal/readahead"
	"github.com/seed-a3c387e8/onceproxy/internal/redact"
	"github.com/seed-a3c387e8/onceproxy/internal/workers"
	"github.com/seed-a3c387e8/onceproxy/proxy/ratelimit"
	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
)

// CertSource provides the server side of intercepted TLS: a config whose
// certificates are minted for the client's SNI, falling back to the CONNECT
// host when the client sends none. *mitm.Authority satisfies it.
type CertSource interface {
	ServerConfig(fallbackHost string) *tls.Config
}

// UserStore verifies proxy users. Verify receives the client
// (clientinfo.ClientOf its address) and the user name exactly as the
// client sent it, session hints included ("acct-session-abc"); a store
// that knows accounts only can split it with clientinfo.ParseUser. A
// refusal with a retryAfter says the client is not being checked for
// that long (too many failures).
type UserStore interface {
	Verify(client, user, password string) (ok bool, retryAfter time.Duration)
}

// Upstream is where traffic leaves the proxy: requests through RoundTrip,
// blind tunnels through DialContext. *upstream.Forwarder satisfies it.
type Upstream interface {
	http.RoundTripper
	DialContext(ctx context.Context, network, addr string) (net.Conn, error)
}

// Options are the parts a Server is wired from.
type Options struct {
	// Logger receives access lines and errors. Required.
	Logger *slog.Logger
	// Certs mints certificates for intercepted hosts. Required.
	Certs CertSource
	// Upstream sends requests and opens tunnels. Required.
	Upstream Upstream
	// Next handles every request that may be deduplicated; nil means
	// Upstream (no dedup).
	Next http.RoundTripper
	// AccessLog enables one log line per request and per tunnel.
	AccessLog bool
	// Users verifies proxy users: Proxy-Authorization on the HTTP port
	// (407 with a Basic challenge otherwise), RFC 1929 on the SOCKS5 port.
	// nil means no user store: the HTTP port is open, SOCKS5 clients are
	// let in only if socks5.allow_no_auth is set.
	Users UserStore
	// Realm names the proxy in Proxy-Authenticate challenges.
	Realm string
	// Limiter caps requests per client (429 beyond); nil: no limit.
	Limiter *ratelimit.Limiter
	// Guard refuses private and loopback targets before anything is
	// dialled (the upstream re-checks the resolved address at dial time);
	// nil: no early check.
	Guard TargetGuard
	// Metrics records requests and refusals; nil records nothing.
	Metrics *metrics.Metrics
	// Origins says which protocol each HTTPS origin chose when last
	// reached, for the MITM to offer a client the same (see
	// clientProtos); nil: the MITM offers HTTP/2 and HTTP/1.1 whatever
	// the origin speaks.
	Origins OriginProtocols
}

// OriginProtocols reports which application protocol (ALPN: "h2",
// "http/1.1", "" for none) the HTTPS origin at addr (host:port) chose the
// last time it was offered HTTP/2, and whether that is known.
// *upstream.Pool satisfies it.
type OriginProtocols interface {
	OriginProtocol(addr string) (proto string, known bool)
}

// TargetGuard decides whether a target host may be reached. The returned
// context carries the decision to the dial-time check (allow-listed names
// are not re-checked there). *netguard.Guard satisfies it.
type TargetGuard interface {
	CheckHostContext(ctx context.Context, host string) (context.Context, error)
}

// Server is the HTTP proxy. Create it with New, run it with Serve, stop it
// with Shutdown.
type Server struct {
	cfg        Config
	bypass     *hostmatch.Set // cfg.BypassHosts
	logger     *slog.Logger
	certs      CertSource
	upstream   Upstream
	next       http.RoundTripper
	accessLog  bool
	users      UserStore
	realm      string
	limiter    *ratelimit.Limiter
	guard      TargetGuard
	metrics    *metrics.Metrics
	origins    OriginProtocols
	mitmAction *goproxy.ConnectAction
	gp         *goproxy.ProxyHttpServer
	srv        *http.Server
	// inner serves the requests inside intercepted tunnels (intercept.go).
	inner        *http.Server
	innerLn      *pushListener
	innerMu      sync.Mutex
	innerStarted bool
	innerClosed  bool
	innerWG      sync.WaitGroup
	// The lean loops (h1loop.go) of the proxy port and of the tunnels;
	// portLn hands the proxy port's other connections to srv.
	port, tunnels h1Loop
	portLn        *pushListener
	closing       atomic.Bool // Shutdown began
	// handlers serve the HTTP/2 requests of intercepted tunnels
	// (serveIntercepted).
	handlers workers.Pool

	doorsMu     sync.Mutex
	doors       []*socks.Server // SOCKS5 doors (ServeSOCKS5), stopped by Shutdown
	doorsClosed bool

	ln       atomic.Pointer[connlimit.Listener]
	inflight atomic.Int64 // requests between the handler and the end of their response body

	clientFPs *fingerprint.Tally // fingerprints of intercepted clients, for the status page
}

// New builds a Server; cfg gets its defaults applied.
func New(cfg Config, o Options) (*Server, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("proxy: %w", err)
	}
	if o.Logger == nil || o.Certs == nil || o.Upstream == nil {
		return nil, errors.New("proxy: Logger, Certs and Upstream are required")
	}
	bypass, err := hostmatch.Compile(cfg.BypassHosts)
	if err != nil {
		return nil, fmt.Errorf("proxy: bypass_hosts%w", err)
	}
	s := &Server{
		cfg:       cfg,
		bypass:    bypass,
		logger:    o.Logger,
		certs:     o.Certs,
		upstream:  o.Upstream,
		next:      o.Next,
		accessLog: o.AccessLog,
		users:     o.Users,
		realm:     o.Realm,
		limiter:   o.Limiter,
		guard:     o.Guard,
		metrics:   o.Metrics,
		origins:   o.Origins,
		clientFPs: fingerprint.NewTally(clientFingerprintsKept),
	}
	if s.next == nil {
		s.next = o.Upstream
	}
	s.handlers.MaxIdle = maxIdleHandlers
	if s.realm == "" {
		s.realm = "onceproxy"
	}
	s.mitmAction = &goproxy.ConnectAction{Action: goproxy.ConnectHijack, Hijack: s.hijackConnect}

	gp := goproxy.NewProxyHttpServer()
	gp.Logger = goproxyLogger{o.Logger}
	// NewProxyHttpServer wires the process's HTTPS_PROXY into CONNECT
	// dialing and ProxyFromEnvironment into its transport. Neither may
	// decide where our traffic goes: every path below is ours.
	gp.ConnectDial = nil
	gp.ConnectDialWithReq = s.dialTunnel
	gp.ConnectionErrHandler = s.tunnelError
	gp.Tr = &http.Transport{Proxy: nil, DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		// Unused: handle always answers, so goproxy never forwards on its
		// own. Fail loudly rather than dial if that ever changes.
		return nil, errors.New("proxy: internal: goproxy tried to dial on its own")
	}}
	gp.AllowHTTP2 = true
	gp.KeepAcceptEncoding = true
	gp.NonproxyHandler = http.HandlerFunc(s.nonProxy)
	gp.OnRequest().HandleConnectFunc(s.handleConnect)
	gp.OnRequest().DoFunc(s.handle)

	s.gp = gp
	s.srv = &http.Server{
		Handler:           http.HandlerFunc(s.front),
		ReadHeaderTimeout: cfg.ReadHeaderTimeout,
		IdleTimeout:       cfg.IdleTimeout,
		MaxHeaderBytes:    cfg.MaxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(o.Logger.Handler(), slog.LevelWarn),
		ConnState:         connlimit.ConnState,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return context.WithValue(ctx, clientConnKey{}, c)
		},
	}
	s.inner = s.newInner()
	s.innerLn = newPushListener(&net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	s.portLn = newPushListener(&net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	s.port = h1Loop{
		// Absolute form: the proxy requests. CONNECT and /fetch are
		// srv's (front).
		plain:   func(r *http.Request) bool { return r.URL.IsAbs() },
		handle:  func(w http.ResponseWriter, r *http.Request) { s.forward(streamTo(w), r) },
		handOff: s.pushPort,
		base: func(c *tappedConn) context.Context {
			return context.WithValue(context.Background(), clientConnKey{}, c)
		},
	}
	s.tunnels = h1Loop{
		plain:   func(*http.Request) bool { return true },
		handle:  s.serveDecrypted,
		handOff: s.pushInner,
		base: func(c *tappedConn) context.Context {
			return context.WithValue(context.Background(), tunnelKey{}, c.t)
		},
	}
	return s, nil
}

// pushPort hands a proxy-port connection to srv.
func (s *Server) pushPort(c *tappedConn) {
	if err := s.portLn.push(c); err != nil {
		c.Close() // shutting down
	}
}

// front is the proxy port's handler: a CONNECT goes to goproxy, with the
// bytes a client sent right behind it (a TLS ClientHello in the same
// write) kept for whoever takes the tunnel over; a request, to forward.
func (s *Server) front(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodConnect {
		s.gp.ServeHTTP(keepBufferedOnHijack{w}, r)
		return
	}
	fw := streamTo(w)
	if !r.URL.IsAbs() && r.URL.Path == fetchPath {
		s.fetch(fw, r)
		return
	}
	s.forward(fw, r)
}

// keepBufferedOnHijack hands the hijacker a connection that replays what
// http.Server had already read past the request, instead of leaving it in
// a reader that goproxy's ConnectHijack does not pass on.
type keepBufferedOnHijack struct{ http.ResponseWriter }

func (k keepBufferedOnHijack) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	c, rw, err := http.NewResponseController(k.ResponseWriter).Hijack()
	if err != nil {
		return nil, nil, err
	}
	if tc, ok := c.(*tappedConn); ok {
		// The tap has stopped at the CONNECT; what follows is the
		// tunnel's, tapped on its own if it is intercepted.
		c = tc.NetConn()
	}
	c = readahead.Buffered(c, rw.Reader)
	return c, bufio.NewReadWriter(bufio.NewReader(c), bufio.NewWriter(c)), nil
}

// connLimits are the limits both doors put on their client connections.
func (s *Server) connLimits() connlimit.Config {
	return connlimit.Config{MaxConns: s.cfg.MaxConns, IdleTimeout: s.cfg.IdleTimeout, MaxPerClient: s.cfg.MaxConnsPerClient}
}

// clientConnKey carries a proxy-port request's client connection in its
// context, for the per-client connection cap.
type clientConnKey struct{}

// attribute counts the connection a request arrived on against the
// authenticated account it names, for proxy.max_conns_per_client (until
// then it counts against its address). It returns the response refusing
// the request when that account already holds its share.
func (s *Server) attribute(req *http.Request, info clientinfo.Info) *http.Response {
	c, _ := req.Context().Value(clientConnKey{}).(net.Conn)
	if c == nil || info.Account == "" {
		return nil
	}
	if err := connlimit.Attribute(c, info.Client); err != nil {
		// The refused connection closes after the 429. The writers (the
		// lean loop's, net/http's) learn that from the header: forward
		// copies no resp.Close, which an origin's own "Connection: close"
		// also sets and must not pass on.
		resp := errorResponse(req, http.StatusTooManyRequests, kindTooManyConns, err.Error())
		resp.Close = true
		resp.Header.Set("Connection", "close")
		return resp
	}
	return nil
}

// ConnStats sums the client connection counts of both doors.
func (s *Server) ConnStats() connlimit.Stats {
	var st connlimit.Stats
	if cl := s.ln.Load(); cl != nil {
		st = cl.Stats()
	}
	s.doorsMu.Lock()
	doors := s.doors
	s.doorsMu.Unlock()
	for _, d := range doors {
		st = st.Add(d.ConnStats())
	}
	return st
}

// nonProxy answers requests that are not proxy requests (origin-form, as if
// onceproxy were a web server).
func (s *Server) nonProxy(w http.ResponseWriter, r *http.Request) {
	resp := errorResponse(r, http.StatusBadRequest, kindBadRequest,
		"this is a forward proxy: send absolute-form requests (GET http://host/path) or CONNECT host:port, or use GET /fetch?url=<URL>")
	writeResponse(w, resp)
}

// Serve accepts proxy clients on ln until Shutdown. It returns nil after a
// Shutdown, or the error that stopped it.
//
// Each connection is tapped (for the header order of plain http://
// requests) and served by the proxy port's lean loop, which hands it to
// srv at the first request it does not answer itself (a CONNECT, say).
func (s *Server) Serve(ln net.Listener) error {
	cl := connlimit.New(ln, s.connLimits())
	s.ln.Store(cl)
	if s.closing.Load() {
		// Shutdown came first (it closes what it finds in s.ln).
		cl.Close()
		return nil
	}
	s.logger.Info("proxy listening", "addr", ln.Addr().String())
	srvDone := make(chan error, 1)
	go func() { srvDone <- s.srv.Serve(s.portLn) }()
	// EMFILE and the like pass, as net/http's server lets them.
	passes := func(err error) bool {
		var tmp interface{ Temporary() bool }
		return !s.closing.Load() && errors.As(err, &tmp) && tmp.Temporary()
	}
	for {
		c, err := connlimit.AcceptRetrying(context.Background(), cl, s.logger, "proxy", passes)
		if err != nil {
			if s.closing.Load() {
				if err := <-srvDone; !errors.Is(err, http.ErrServerClosed) {
					return err
				}
				return nil
			}
			s.portLn.Close()
			<-srvDone
			return err
		}
		go s.serveH1(&s.port, &tappedConn{Conn: capture.NewConn(c, nil)})
	}
}

// Shutdown stops accepting clients (HTTP and SOCKS5), lets in-flight
// requests finish until ctx ends, then cuts every remaining connection (idle
// keep-alives, MITM sessions, tunnels, WebSockets, SOCKS5 clients).
func (s *Server) Shutdown(ctx context.Context) error {
	// The SOCKS5 doors stop accepting at once, and cut what is left of
	// their connections (blind tunnels) when the drain below is over.
	s.doorsMu.Lock()
	s.doorsClosed = true
	doors := s.doors
	s.doorsMu.Unlock()
	drained, cut := context.WithCancel(context.Background())
	var doorsDone sync.WaitGroup
	for _, d := range doors {
		doorsDone.Go(func() { _ = d.Shutdown(drained) })
	}
	// All at once: keep-alive clients inside tunnels must hear "go away"
	// while plain requests drain, not after.
	s.closing.Store(true)
	if cl := s.ln.Load(); cl != nil {
		cl.Close() // no new clients; Serve returns
	}
	parts := []struct {
		name string
		stop func(context.Context) error // waits for its requests
	}{
		{"the proxy port's server", s.srv.Shutdown},
		{"the proxy port's lean loop", s.port.conns.shutdown},
		{"the tunnels' server", s.shutdownInner},
		{"the tunnels' lean loop", s.tunnels.conns.shutdown},
	}
	errs := make([]error, len(parts))
	var stopping sync.WaitGroup
	for i, p := range parts {
		stopping.Go(func() { errs[i] = p.stop(ctx) })
	}
	stopping.Wait()
	var err error
	var late []string // what the grace ran out on, for the log
	for i, e := range errs {
		if e != nil {
			late = append(late, parts[i].name)
			if err == nil {
				err = e
			}
		}
	}
	// Requests whose connection left the servers (WebSocket upgrades) are
	// invisible to them: wait for those ourselves.
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for s.inflight.Load() > 0 && ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case <-tick.C:
		}
	}
	left := s.inflight.Load()
	if cl := s.ln.Load(); cl != nil {
		cl.CloseAll()
	}
	cut()
	doorsDone.Wait()
	// The requests left end with their connections, and their workers
	// with them.
	_ = s.handlers.Stop(ctx)
	if left > 0 || len(late) > 0 {
		if err == nil {
			err = ctx.Err()
		}
		// The caller says it, once, with the setting to tune: a cut
		// drain is how the stop it asked for ended, not a failure.
		err = &GraceError{Requests: left, WaitingFor: late, Err: err}
	}
	return err
}

// GraceError is Shutdown's answer when ctx ended before every request in
// flight did: those were cut.
type GraceError struct {
	// Requests is how many requests were still being served.
	Requests int64
	// WaitingFor names the parts that had not drained.
	WaitingFor []string
	// Err is why the wait ended (ctx's error).
	Err error
}

func (e *GraceError) Error() string {
	return fmt.Sprintf("shutdown grace over: cut %d requests still in flight (waiting for %s): %v",
		e.Requests, strings.Join(e.WaitingFor, ", "), e.Err)
}

func (e *GraceError) Unwrap() error { return e.Err }

// maxIdleHandlers bounds the handler workers kept waiting: enough for the
// HTTP/2 streams a loaded instance serves at once.
const maxIdleHandlers = 256

// Inflight returns the number of requests being served.
func (s *Server) Inflight() int64 { return s.inflight.Load() }

// ShuttingDown reports whether Shutdown has begun: the ports take no new
// client while the requests in flight drain.
func (s *Server) ShuttingDown() bool { return s.closing.Load() }

// goproxyLogger sends goproxy's printf-style warnings to slog.
type goproxyLogger struct{ l *slog.Logger }

func (g goproxyLogger) Printf(format string, v ...any) {
	// goproxy quotes URLs in some warnings (Cannot parse URL ...).
	msg := redact.Text(strings.TrimSpace(fmt.Sprintf(format, v...)))
	level := slog.LevelDebug
	if strings.Contains(msg, "WARN:") {
		level = slog.LevelWarn
	}
	g.l.Log(context.Background(), level, "goproxy: "+msg)
}
