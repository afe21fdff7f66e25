// Package fakeprovider is a rotating-proxy provider on loopback, for tests:
// an HTTP gateway (CONNECT and absolute-form), a SOCKS5 gateway and the
// RoProxy-style session API, with switches that make any part misbehave.
//
// Each session has its own credentials and a current exit IP taken from
// 127.0.0.2 … 127.0.0.50: the gateways dial the target from that source
// address, so a loopback origin sees which "exit IP" served it in
// r.RemoteAddr. Rotating a session (through the API or Rotate) moves it to
// another address and cuts its open tunnels, as real providers do.
// Rotation modes behave like the real ones: sticky keeps its IP until
// rotated, timed moves every Interval (by Options.Now, checked lazily on
// use: no timers), per_request takes a new IP for every gateway
// connection (every CONNECT, SOCKS5 connect and absolute-form request).
//
// The API, with "Authorization: Bearer <APIKey>" (401 otherwise):
//
//	GET  /api/session              200 {"sessions": [Wire, ...]}
//	POST /api/session/{id}/rotate  200 Wire (with the new exit_ip); 404 unknown id
//
// where Wire is
//
//	{"id": "s1", "username": "acct-session-s1", "password": "…",
//	 "gateway_host": "127.0.0.1", "http_port": 40001, "socks5_port": 40002,
//	 "rotation": "sticky", "interval_seconds": 0, "exit_ip": "127.0.0.2"}
//
// Options.Countries (or SetCountry) gives sessions a "country" in their
// API objects; two providers in one test are two Start calls (their
// sessions are both s1, s2, …: upstream.providers names them NAME.s1).
//
// Typical use:
//
//	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 3})
//	cfg := upstream.Config{Provider: upstream.ProviderConfig{API: fp.APIURL(), APIKey: fp.APIKey()}}
//	// or one session by hand: upstream.SessionConfig{ID: "a", URL: fp.URL("s1", "socks5")}
//	fp.SetMode("s2", fakeprovider.Mode429) // the gateway rate-limits s2
//	fp.SetAPIMode(fakeprovider.APIGarbage) // the API answers nonsense
//	s1, _ := fp.Session("s1")              // s1.ExitIP is what a loopback origin sees
//	n := fp.Requests("s1")                 // uses of s1 at the gateways
//
// Nothing here is safe for anything but tests: no limits, no TLS.
package fakeprovider

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strconv"
	"sync"
	"testing"
	"time"
)

// Rotation modes, as in the API.
const (
	Sticky     = "sticky"
	Timed      = "timed"
	PerRequest = "per_request"
)

// Mode is how the gateways treat one session.
type Mode int

const (
	// ModeOK serves the session normally.
	ModeOK Mode = iota
	// ModeRefuse closes the client connection without an answer (HTTP) or
	// replies "connection refused" (SOCKS5).
	ModeRefuse
	// Mode429 answers 429 at the gateway (to CONNECT and absolute-form
	// requests, with Proxy-Status naming the gateway's own error). SOCKS5
	// has no reply for a rate limit: it gets "host unreachable", what
	// go-socks5 replies to any failed dial, as for Mode502.
	Mode429
	// Mode502 answers 502 at the gateway (SOCKS5: "host unreachable").
	Mode502
	// ModeHang accepts and never answers, until the client gives up, the
	// mode changes or the provider closes.
	ModeHang
)

// APIMode is how the session API answers.
type APIMode int

const (
	// APIOK answers normally.
	APIOK APIMode = iota
	// APIGarbage answers 200 with a body that is not JSON.
	APIGarbage
	// APIEmpty answers 200 {"sessions": []}.
	APIEmpty
	// API500 answers 500.
	API500
	// APIHang never answers, until the client gives up.
	APIHang
	// API429 answers 429 with Retry-After: 30 (Options.APIRetryAfter), as
	// a rate-limited API does.
	API429
)

// Options configure a Provider. Zero values are the documented defaults.
type Options struct {
	// Sessions is how many sessions exist at start (ids s1, s2, …). Default 1.
	Sessions int
	// Rotation of those sessions: Sticky (default), Timed or PerRequest.
	Rotation string
	// Interval of Timed sessions. Default 1m.
	Interval time.Duration
	// APIKey is the bearer token the API expects. Default "test-api-key".
	APIKey string
	// Now is the clock of timed rotation. Default time.Now.
	Now func() time.Time
	// ExitIPs are the last bytes of the exit IPs handed out,
	// 127.0.0.ExitIPs[0] … 127.0.0.ExitIPs[1], so that two providers in one
	// test exit from addresses of their own. Default [2, 50].
	ExitIPs [2]byte
	// Countries are the countries of the sessions made at start, in turn
	// (s1 gets Countries[0], s2 Countries[1], …, wrapping around), sent as
	// each session object's "country". Default none.
	Countries []string
	// KeepTunnels leaves a session's open tunnels on its old exit IP when
	// it rotates, as gateways that only route new connections do. By
	// default a rotation cuts them.
	KeepTunnels bool
	// APIRetryAfter is the Retry-After of API429's answers, in seconds.
	// Default 30.
	APIRetryAfter int
}

// Session is a snapshot of one session.
type Session struct {
	ID       string
	Username string
	Password string
	Rotation string
	Interval time.Duration
	// ExitIP is the current source address ("127.0.0.2"); for per_request
	// sessions the one the last connection got.
	ExitIP string
	// Country is what the API says of the session ("" nothing).
	Country string
}

// Wire is a session as the API sends it. upstream's provider client parses
// exactly this.
type Wire struct {
	ID              string  `json:"id"`
	Username        string  `json:"username"`
	Password        string  `json:"password"`
	GatewayHost     string  `json:"gateway_host"`
	HTTPPort        int     `json:"http_port"`
	SOCKS5Port      int     `json:"socks5_port"`
	Rotation        string  `json:"rotation"`
	IntervalSeconds float64 `json:"interval_seconds"`
	ExitIP          string  `json:"exit_ip"`
	Country         string  `json:"country,omitempty"`
}

// exit IPs are 127.0.0.firstIP … 127.0.0.lastIP.
const (
	firstIP = 2
	lastIP  = 50
)

type session struct {
	Session
	ip         netip.Addr
	nextRotate time.Time // timed
	mode       Mode
	unhang     chan struct{} // closed when the mode leaves ModeHang
	requests   int64
	conns      int64
	rotations  int64
	tunnels    map[net.Conn]struct{} // target side of open tunnels
}

// Provider is a running fake provider. Create it with New or Start.
type Provider struct {
	opts Options

	mu       sync.Mutex // guards everything below up to socksConns
	sessions map[string]*session
	order    []string
	byUser   map[string]*session
	nextID   int
	cursor   int // next exit IP candidate, firstIP…lastIP
	apiMode  APIMode
	apiUnh   chan struct{} // closed when the API leaves APIHang
	apiCalls int64
	// socksConns are the SOCKS5 client connections, closed by Close.
	socksConns map[net.Conn]struct{}
	// blocked are the targets (host:port) the provider's policy refuses
	// through every session (Block).
	blocked map[string]bool

	closing   chan struct{} // closed (under mu) by Close
	closeOnce sync.Once
	wg        sync.WaitGroup // tunnel pumps and SOCKS5 connections

	api, gw *httptest.Server
	socksLn net.Listener
}

// New starts a provider on loopback.
func New(o Options) (*Provider, error) {
	if o.Sessions == 0 {
		o.Sessions = 1
	}
	if o.Rotation == "" {
		o.Rotation = Sticky
	}
	if o.Interval == 0 {
		o.Interval = time.Minute
	}
	if o.APIKey == "" {
		o.APIKey = "test-api-key"
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.ExitIPs == [2]byte{} {
		o.ExitIPs = [2]byte{firstIP, lastIP}
	}
	if o.ExitIPs[0] < 2 || o.ExitIPs[1] < o.ExitIPs[0] || o.ExitIPs[1] == 255 {
		return nil, fmt.Errorf("fakeprovider: bad exit IP range %v", o.ExitIPs)
	}
	switch o.Rotation {
	case Sticky, Timed, PerRequest:
	default:
		return nil, fmt.Errorf("fakeprovider: unknown rotation %q", o.Rotation)
	}
	p := &Provider{
		opts:       o,
		sessions:   map[string]*session{},
		byUser:     map[string]*session{},
		cursor:     int(o.ExitIPs[0]),
		apiUnh:     make(chan struct{}),
		socksConns: map[net.Conn]struct{}{},
		blocked:    map[string]bool{},
		closing:    make(chan struct{}),
	}
	close(p.apiUnh)
	for i := range o.Sessions {
		s := p.AddSession(o.Rotation, o.Interval)
		if len(o.Countries) > 0 {
			p.SetCountry(s.ID, o.Countries[i%len(o.Countries)])
		}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("fakeprovider: socks5 listener: %w", err)
	}
	p.socksLn = ln
	p.api = httptest.NewServer(p.apiHandler())
	p.gw = httptest.NewUnstartedServer(http.HandlerFunc(p.serveGateway))
	p.gw.Config.ConnContext = withGatewayConn
	p.gw.Start()
	p.startSOCKS5()
	return p, nil
}

// Start is New for tests: it fails tb on error and closes the provider
// when the test ends.
func Start(tb testing.TB, o Options) *Provider {
	tb.Helper()
	p, err := New(o)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(p.Close)
	return p
}

// Close stops every listener, cuts every tunnel and waits for the
// provider's goroutines. It is idempotent.
func (p *Provider) Close() {
	p.closeOnce.Do(p.close)
}

func (p *Provider) close() {
	p.mu.Lock()
	close(p.closing)
	for _, s := range p.sessions {
		for c := range s.tunnels {
			cutLocked(s.tunnels, c)
		}
	}
	for c := range p.socksConns {
		cutLocked(p.socksConns, c)
	}
	p.mu.Unlock()
	p.socksLn.Close()
	p.gw.CloseClientConnections()
	p.gw.Close()
	p.api.CloseClientConnections()
	p.api.Close()
	p.wg.Wait()
}

// APIURL is the API base URL (for upstream.provider.api).
func (p *Provider) APIURL() string { return p.api.URL }

// APIKey is the bearer token the API accepts.
func (p *Provider) APIKey() string { return p.opts.APIKey }

// HTTPAddr is the HTTP gateway's host:port.
func (p *Provider) HTTPAddr() string { return p.gw.Listener.Addr().String() }

// SOCKS5Addr is the SOCKS5 gateway's host:port.
func (p *Provider) SOCKS5Addr() string { return p.socksLn.Addr().String() }

// URL is the gateway URL of session id with its credentials, for
// upstream.sessions[].url: scheme "http" or "socks5".
func (p *Provider) URL(id, scheme string) string {
	p.mu.Lock()
	s := p.sessions[id]
	p.mu.Unlock()
	if s == nil {
		return ""
	}
	addr := p.HTTPAddr()
	if scheme == "socks5" {
		addr = p.SOCKS5Addr()
	}
	u := url.URL{Scheme: scheme, User: url.UserPassword(s.Username, s.Password), Host: addr}
	return u.String()
}

// AddSession creates a session and returns it. Its id is the next sN.
func (p *Provider) AddSession(rotation string, interval time.Duration) Session {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.nextID++
	id := "s" + strconv.Itoa(p.nextID)
	s := &session{
		Session: Session{
			ID:       id,
			Username: "acct-session-" + id,
			Password: randomHex(8),
			Rotation: rotation,
		},
		tunnels: map[net.Conn]struct{}{},
		unhang:  closedChan(),
	}
	if rotation == Timed {
		s.Interval = interval
		s.nextRotate = p.opts.Now().Add(interval)
	}
	s.ip = p.allocIPLocked(s)
	p.sessions[id] = s
	p.order = append(p.order, id)
	p.byUser[s.Username] = s
	return s.snapshot()
}

// RemoveSession deletes a session; its tunnels are cut.
func (p *Provider) RemoveSession(id string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.sessions[id]
	if s == nil {
		return
	}
	for c := range s.tunnels {
		cutLocked(s.tunnels, c)
	}
	delete(p.sessions, id)
	delete(p.byUser, s.Username)
	for i, o := range p.order {
		if o == id {
			p.order = append(p.order[:i], p.order[i+1:]...)
			break
		}
	}
}

// Sessions lists the sessions in creation order.
func (p *Provider) Sessions() []Session {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]Session, 0, len(p.order))
	for _, id := range p.order {
		out = append(out, p.sessions[id].snapshot())
	}
	return out
}

// Session returns one session.
func (p *Provider) Session(id string) (Session, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.sessions[id]
	if s == nil {
		return Session{}, false
	}
	return s.snapshot(), true
}

// ErrUnknownSession is returned for an id the provider does not have.
var ErrUnknownSession = errors.New("fakeprovider: unknown session")

// Rotate moves session id to a new exit IP, as the rotate API does, and
// returns it.
func (p *Provider) Rotate(id string) (string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.sessions[id]
	if s == nil {
		return "", fmt.Errorf("%w %q", ErrUnknownSession, id)
	}
	p.rotateLocked(s)
	return s.ip.String(), nil
}

// rotateLocked gives s a new IP and cuts its tunnels (unless KeepTunnels):
// connections from the old IP do not survive a rotation.
func (p *Provider) rotateLocked(s *session) {
	s.ip = p.allocIPLocked(s)
	s.ExitIP = s.ip.String()
	s.rotations++
	if p.opts.KeepTunnels {
		return
	}
	for c := range s.tunnels {
		cutLocked(s.tunnels, c)
	}
}

// cutLocked closes a tracked connection and forgets it, with p.mu held:
// it closes the inner connection directly, because trackedConn.Close would
// take p.mu again to unregister itself.
func cutLocked(set map[net.Conn]struct{}, c net.Conn) {
	if tc, ok := c.(*trackedConn); ok {
		tc.Conn.Close()
	} else {
		c.Close()
	}
	delete(set, c)
}

// SetCountry sets what the API says session id's country is.
func (p *Provider) SetCountry(id, country string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if s := p.sessions[id]; s != nil {
		s.Country = country
	}
}

// SetMode switches how the gateways treat session id.
func (p *Provider) SetMode(id string, m Mode) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.sessions[id]
	if s == nil {
		return
	}
	if s.mode == ModeHang && m != ModeHang {
		close(s.unhang)
	}
	if m == ModeHang && s.mode != ModeHang {
		s.unhang = make(chan struct{})
	}
	s.mode = m
}

// Block makes the provider refuse target (host:port) by policy, through
// every session, as providers refuse domains they do not serve: CONNECT
// and absolute-form requests are answered 403, a SOCKS5 CONNECT
// "connection not allowed by ruleset".
func (p *Provider) Block(target string) {
	p.mu.Lock()
	p.blocked[target] = true
	p.mu.Unlock()
}

func (p *Provider) isBlocked(target string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.blocked[target]
}

// SetAPIMode switches how the API answers.
func (p *Provider) SetAPIMode(m APIMode) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.apiMode == APIHang && m != APIHang {
		close(p.apiUnh)
	}
	if m == APIHang && p.apiMode != APIHang {
		p.apiUnh = make(chan struct{})
	}
	p.apiMode = m
}

// Requests counts the uses of session id at the gateways: absolute-form
// requests, CONNECT tunnels and SOCKS5 connects that got past the
// credentials check.
func (p *Provider) Requests(id string) int64 {
	return p.counter(id, func(s *session) int64 { return s.requests })
}

// Conns counts the client connections to the gateways that carried
// session id: a keep-alive connection counts once however many requests
// it carries.
func (p *Provider) Conns(id string) int64 {
	return p.counter(id, func(s *session) int64 { return s.conns })
}

// Rotations counts the rotations of session id (API and Rotate).
func (p *Provider) Rotations(id string) int64 {
	return p.counter(id, func(s *session) int64 { return s.rotations })
}

// APICalls counts requests to the API, answered or not.
func (p *Provider) APICalls() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.apiCalls
}

func (p *Provider) counter(id string, f func(*session) int64) int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	if s := p.sessions[id]; s != nil {
		return f(s)
	}
	return 0
}

func (s *session) snapshot() Session {
	out := s.Session
	out.ExitIP = s.ip.String()
	return out
}

func (p *Provider) wire(s *session) Wire {
	_, hp, _ := net.SplitHostPort(p.HTTPAddr())
	_, sp, _ := net.SplitHostPort(p.SOCKS5Addr())
	httpPort, _ := strconv.Atoi(hp)
	socksPort, _ := strconv.Atoi(sp)
	return Wire{
		ID:              s.ID,
		Username:        s.Username,
		Password:        s.Password,
		GatewayHost:     "127.0.0.1",
		HTTPPort:        httpPort,
		SOCKS5Port:      socksPort,
		Rotation:        s.Rotation,
		IntervalSeconds: s.Interval.Seconds(),
		ExitIP:          s.ip.String(),
		Country:         s.Country,
	}
}

// allocIPLocked picks the next exit IP that no other sticky or timed
// session currently holds, and differs from s's current one.
func (p *Provider) allocIPLocked(s *session) netip.Addr {
	held := map[netip.Addr]bool{}
	for _, o := range p.sessions {
		if o != s && o.Rotation != PerRequest {
			held[o.ip] = true
		}
	}
	first, last := int(p.opts.ExitIPs[0]), int(p.opts.ExitIPs[1])
	for range last - first + 1 {
		a := netip.AddrFrom4([4]byte{127, 0, 0, byte(p.cursor)})
		p.cursor++
		if p.cursor > last {
			p.cursor = first
		}
		if !held[a] && a != s.ip {
			return a
		}
	}
	// More sessions than addresses: share.
	return netip.AddrFrom4([4]byte{127, 0, 0, byte(p.cursor)})
}

// exitFor returns the source address for a new connection of s, applying
// the rotation mode. It counts the use.
func (p *Provider) exitFor(s *session) netip.Addr {
	p.mu.Lock()
	defer p.mu.Unlock()
	s.requests++
	switch s.Rotation {
	case PerRequest:
		s.ip = p.allocIPLocked(s)
	case Timed:
		if now := p.opts.Now(); !now.Before(s.nextRotate) {
			s.ip = p.allocIPLocked(s)
			for !now.Before(s.nextRotate) {
				s.nextRotate = s.nextRotate.Add(s.Interval)
			}
		}
	}
	s.ExitIP = s.ip.String()
	return s.ip
}

// dialFrom connects to addr from the source address ip.
func (p *Provider) dialFrom(ip netip.Addr, addr string) (net.Conn, error) {
	d := net.Dialer{
		LocalAddr: &net.TCPAddr{IP: ip.AsSlice()},
		Timeout:   5 * time.Second,
	}
	return d.Dial("tcp", addr)
}

// trackTunnel registers the target side of a tunnel of s, so a rotation or
// Close can cut it; the returned conn unregisters itself when closed.
func (p *Provider) trackTunnel(s *session, c net.Conn) net.Conn {
	tc := &trackedConn{Conn: c}
	tc.onClose = func() {
		p.mu.Lock()
		delete(s.tunnels, tc)
		p.mu.Unlock()
	}
	p.mu.Lock()
	s.tunnels[tc] = struct{}{}
	p.mu.Unlock()
	return tc
}

// modeOf returns the session's mode and, for ModeHang, the channel closed
// when it ends.
func (p *Provider) modeOf(s *session) (Mode, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return s.mode, s.unhang
}

// userSession checks credentials.
func (p *Provider) userSession(user, pass string) *session {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.byUser[user]
	if s == nil || s.Password != pass {
		return nil
	}
	return s
}

type trackedConn struct {
	net.Conn
	once    sync.Once
	onClose func()
}

func (c *trackedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		if c.onClose != nil {
			c.onClose()
		}
	})
	return err
}

// CloseWrite half-closes when the underlying conn can.
func (c *trackedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func closedChan() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}
