package upstream

import (
	"context"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	xproxy "golang.org/x/net/proxy"

	"github.com/seed-a3c387e8/onceproxy/internal/idleconn"
)

// Session sources, shown in the admin API.
const (
	sourceConfig   = "config"
	sourceProvider = "provider"
)

// sessionSpec describes a session before it has connections: from the
// config or from one entry of the provider's list.
type sessionSpec struct {
	id       string
	apiID    string // the id the provider's API knows it by (id without "NAME.")
	source   string
	proxyURL *url.URL // with credentials
	rotation string
	interval time.Duration
	weight   int
	exitIP   string // as the provider reported it; "" unknown
	country  string // ISO 3166-1 alpha-2, upper-case; "" unknown
	city     string // lower-case; "" unknown
	prov     *provider
	gw       *gateway // the health of its gateway address, shared
}

// same reports whether a refresh can keep the existing session for spec.
func (s *session) same(spec sessionSpec) bool {
	return s.proxyURL.String() == spec.proxyURL.String() && s.rotation == spec.rotation &&
		s.interval == spec.interval && s.baseWeight == spec.weight && s.country == spec.country && s.city == spec.city &&
		s.apiID == spec.apiID
}

// session is one upstream proxy session: a gateway URL with its own
// credentials and its own connections. Sessions never share a connection:
// each has its own transports (net/http's and the mirrored one), so the
// idle pool of one can never hand a connection (an exit IP) to another.
type session struct {
	id         string
	apiID      string
	source     string
	proxyURL   *url.URL
	rotation   string
	interval   time.Duration
	baseWeight int
	perRequest bool
	idHash     uint64
	country    string
	city       string
	// prov is the session's group; a reconfiguration that keeps the
	// session may give it a new one.
	prov atomic.Pointer[provider]
	gw   *gateway

	// net holds net/http's transports for the current exit IP; a
	// rotation replaces them (renew).
	net netSet
	// mirror carries the requests of intercepted clients with their own
	// fingerprint, over the same tunnels as net's tls transport (plain
	// http too, through a SOCKS5 gateway).
	mirror *mirroredTransport
	// tunnel opens a byte tunnel to addr through the gateway.
	tunnel func(ctx context.Context, addr string) (net.Conn, error)

	// h is shared with the session this one replaced under its id
	// (inherit), and with its successor: requests still running on a
	// replaced session mark the one that took its place.
	h         *health
	exitIP    atomic.Pointer[string]
	gen       atomic.Uint64 // bumped by every rotation: a new exit IP
	rotateSem chan struct{} // one provider rotation of this session at a time
	// rotateFailGen and rotateFailUntil record the last failed rotation
	// after a 429 or ban: the generation it was for and the end of its
	// backoff (rotateAfterFailure). Guarded by rotateSem.
	rotateFailGen   uint64
	rotateFailUntil time.Time
	// notAtProvider: the provider answered 404 for this configured
	// session; it is not one of its sessions and is never rotated again.
	notAtProvider atomic.Bool
	recycleAt     atomic.Int64 // timed: unix nanos of the next idle-connection recycle
	// answerWait bounds the read of a gateway's own answer to a plain-http
	// request (dial_timeout, as for its answer to CONNECT).
	answerWait time.Duration
}

// transportFor picks the transport for req: the mirrored one for a
// client's fingerprint when the rule mirrors, else net/http's for req's
// scheme.
func (s *session) transportFor(req *http.Request, mirror bool) http.RoundTripper {
	if mirror && s.mirror.takes(req) {
		return s.mirror
	}
	nt := s.net.current()
	if req.URL.Scheme == "http" {
		return nt.plain
	}
	return nt.tls
}

func (s *session) setExitIP(ip string) {
	if ip != "" {
		s.exitIP.Store(&ip)
	}
}

func (s *session) currentExitIP() string {
	if p := s.exitIP.Load(); p != nil {
		return *p
	}
	return ""
}

// rotatedTo records a rotation (made here, or by another instance of the
// fleet): the new exit IP when known, a new generation, and no pooled
// connections, which lead to the old exit IP.
func (s *session) rotatedTo(ip string) {
	s.setExitIP(ip)
	s.gen.Add(1)
	s.renew()
}

// renew retires every connection of the session: the idle ones close now,
// and the busy ones take no request after their current ones. Many
// gateways route only new connections through a rotated session's new exit
// IP, so a connection busy at a rotation leads to the old one for as long
// as it lives.
func (s *session) renew() {
	s.net.renew()
	s.mirror.closeIdle()
}

// closeIdle drops the session's pooled connections: after a rotation they
// lead to the old exit IP. Mirrored connections still busy are retired
// too: they close when done and take no new request.
func (s *session) closeIdle() {
	s.net.closeIdle()
	s.mirror.closeIdle()
}

// close drops the session's pooled connections for good: its mirrored
// transport takes no new request (busy connections close when done).
func (s *session) close() {
	s.closeIdle()
	s.mirror.close()
}

// netSet is a session's net/http transports (or those of direct egress),
// which renew can replace whole: net/http's transports cannot retire a
// busy connection (an HTTP/1.1 one goes back to the idle pool when done,
// an HTTP/2 one takes new streams), so retiring every connection means
// moving to a fresh pair. Replaced pairs are kept while a connection of
// theirs is open, so that closeIdle and pruneOld still reach it.
type netSet struct {
	cur   atomic.Pointer[netTransports]
	build func() *netTransports
	mu    sync.Mutex
	old   []*netTransports
}

func (ns *netSet) init(build func() *netTransports) {
	ns.build = build
	ns.cur.Store(build())
}

func (ns *netSet) current() *netTransports { return ns.cur.Load() }

// renew moves to fresh transports and closes the old ones' idle
// connections; their busy ones close once done (pruneOld).
func (ns *netSet) renew() {
	prev := ns.cur.Swap(ns.build())
	ns.mu.Lock()
	ns.old = append(ns.old, prev)
	ns.mu.Unlock()
	ns.closeIdle()
}

// closeIdle closes the idle connections of the current transports and of
// the replaced ones.
func (ns *netSet) closeIdle() {
	ns.cur.Load().closeIdle()
	ns.pruneOld()
}

// pruneOld closes the idle connections of the replaced transports (the
// connections busy at renew, once they are done), and forgets the
// transports left with none open.
func (ns *netSet) pruneOld() {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	ns.old = slices.DeleteFunc(ns.old, func(nt *netTransports) bool {
		nt.closeIdle()
		return nt.open.Load() == 0
	})
}

// netTransports are net/http's transports of one exit IP. tls carries
// https requests; a session's opens a tunnel to the origin through the
// gateway (CONNECT or SOCKS5) with our own deadline handling. plain
// carries http requests: through an HTTP gateway in absolute form (what
// gateways expect for plain HTTP), else the same transport as tls.
type netTransports struct {
	tls, plain *http.Transport
	open       atomic.Int64 // connections dialled and not yet closed
}

func (nt *netTransports) closeIdle() {
	nt.tls.CloseIdleConnections()
	if nt.plain != nt.tls {
		nt.plain.CloseIdleConnections()
	}
}

// counted wraps dial so that nt.open counts the connections it made.
func (nt *netTransports) counted(dial dialFunc) dialFunc {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		nt.open.Add(1)
		return &countedConn{Conn: c, open: &nt.open}, nil
	}
}

type dialFunc = func(ctx context.Context, network, addr string) (net.Conn, error)

// countedConn takes itself off its transports' count on its first Close.
type countedConn struct {
	net.Conn
	open   *atomic.Int64
	closed atomic.Bool
}

func (c *countedConn) Close() error {
	if c.closed.CompareAndSwap(false, true) {
		c.open.Add(-1)
	}
	return c.Conn.Close()
}

// scrub removes the session's credentials from a message (its password,
// and a user name long enough to be a token): errors of net/http and
// x/net/proxy do not contain them today, and this keeps it that way.
func (s *session) scrub(msg string) string {
	ui := s.proxyURL.User
	if ui == nil {
		return msg
	}
	name := ui.Username()
	pass, _ := ui.Password()
	// A gateway that echoes the request in its refusal quotes the
	// Proxy-Authorization it got: user and password in base64.
	msg = strings.ReplaceAll(msg, base64.StdEncoding.EncodeToString([]byte(name+":"+pass)), "xxxxx")
	// The user name too: some providers take a token as the user name
	// and no password (http://TOKEN:@gw). Only a long one: a short
	// account name is no token, and masking every "bob" in the gateway's
	// message would garble it.
	for _, secret := range []struct {
		v   string
		min int
	}{{pass, 3}, {name, minSecretUser}} {
		if len(secret.v) < secret.min {
			continue
		}
		msg = strings.ReplaceAll(msg, secret.v, "xxxxx")
		if esc := url.QueryEscape(secret.v); esc != secret.v {
			msg = strings.ReplaceAll(msg, esc, "xxxxx")
		}
	}
	return msg
}

// minSecretUser is the shortest gateway user name scrub masks.
const minSecretUser = 8

// connKit is what every transport of the pool is built from.
type connKit struct {
	cfg    Config
	tls    *tls.Config
	dialer *net.Dialer // gateways and the provider API: the operator's own addresses
	// direct dials origins from this host, by address: its Control (the
	// SSRF guard) sees every address connected to.
	direct *net.Dialer
	// lookup resolves the names of origins dialled directly (dialDirect).
	lookup LookupFunc
	// hellos counts origin connections by how their hello was made.
	hellos helloCounts
	// alpn remembers the protocol each origin chose (Pool.OriginProtocol).
	alpn *alpnMemory
	log  *slog.Logger
}

func (k *connKit) idle(c net.Conn) net.Conn { return idleconn.Wrap(c, k.cfg.IdleTimeout) }

// transport builds one http.Transport. keepAlive false makes every request
// open its own connection (per_request sessions: a new exit IP each time).
func (k *connKit) transport(dial dialFunc, proxy *url.URL, keepAlive bool, idleConnTimeout time.Duration) *http.Transport {
	t := &http.Transport{
		// Where requests go is fixed by our configuration, never by
		// ProxyFromEnvironment.
		Proxy:       nil,
		DialContext: dial,
		// A copy each: net/http writes the HTTP/2 ALPN settings into
		// the config of the transport that first uses it.
		TLSClientConfig:       countGoHellos(k.tls, &k.hellos),
		ForceAttemptHTTP2:     true,
		TLSHandshakeTimeout:   k.cfg.TLSHandshakeTimeout,
		ResponseHeaderTimeout: k.cfg.ResponseHeaderTimeout,
		ExpectContinueTimeout: time.Second,
		IdleConnTimeout:       idleConnTimeout,
		MaxIdleConns:          k.cfg.MaxIdleConns,
		MaxIdleConnsPerHost:   k.cfg.MaxIdleConnsPerHost,
		DisableKeepAlives:     !keepAlive,
		// The client's Accept-Encoding goes upstream untouched and the
		// origin's compressed bytes come back untouched: transparent
		// decompression would make us pay for (and cache) the wrong bytes.
		DisableCompression: true,
	}
	if proxy != nil {
		t.Proxy = http.ProxyURL(proxy)
	}
	return t
}

// newSession builds a session and its transports from spec.
func (k *connKit) newSession(spec sessionSpec) (*session, error) {
	s := &session{
		id:         spec.id,
		apiID:      spec.apiID,
		source:     spec.source,
		proxyURL:   spec.proxyURL,
		rotation:   spec.rotation,
		interval:   spec.interval,
		baseWeight: spec.weight,
		perRequest: spec.rotation == RotationPerRequest,
		idHash:     mix64(hashStrings(spec.id)),
		rotateSem:  make(chan struct{}, 1),
		country:    spec.country,
		city:       spec.city,
		gw:         spec.gw,
		h:          new(health),
		answerWait: k.cfg.DialTimeout,
	}
	if s.gw == nil {
		s.gw = &gateway{addr: spec.proxyURL.Host}
	}
	s.prov.Store(spec.prov)
	s.h.init(spec.weight)
	s.setExitIP(spec.exitIP)
	keepAlive := !s.perRequest
	idleTimeout := k.cfg.IdleConnTimeout
	if s.rotation == RotationTimed && s.interval < idleTimeout {
		// A connection kept longer than the rotation interval may still
		// leave from the previous exit IP.
		idleTimeout = s.interval
	}
	pu := spec.proxyURL
	// tunnel is the session's dial; a transport's other ends go through it.
	tunnel := func(ctx context.Context, _, addr string) (net.Conn, error) { return s.tunnel(ctx, addr) }
	switch pu.Scheme {
	case "http":
		s.tunnel = func(ctx context.Context, addr string) (net.Conn, error) {
			c, err := connectThrough(ctx, k.dialer, pu, addr)
			if err != nil {
				return nil, err
			}
			return k.idle(c), nil
		}
		// Absolute-form requests: the transport dials the gateway itself
		// and sends the credentials as Proxy-Authorization.
		gateway := func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := k.dialer.DialContext(ctx, network, addr)
			if err != nil {
				return nil, &DialError{Op: "dial upstream proxy " + pu.Host, Err: err}
			}
			return k.idle(c), nil
		}
		s.net.init(func() *netTransports {
			nt := new(netTransports)
			nt.tls = k.transport(nt.counted(tunnel), nil, keepAlive, idleTimeout)
			nt.plain = k.transport(nt.counted(gateway), pu, keepAlive, idleTimeout)
			return nt
		})
		// Plain http stays with net/http: the gateway wants it in
		// absolute form.
		s.mirror = k.mirroredTransport(tunnel, false, keepAlive, idleTimeout)
	case "socks5":
		if _, err := socks5Dialer(pu, &rawDialer{d: k.dialer}); err != nil {
			return nil, fmt.Errorf("socks5 dialer for session %s: %w", spec.id, err)
		}
		timeout := k.cfg.DialTimeout
		s.tunnel = func(ctx context.Context, addr string) (net.Conn, error) {
			// The transport dials on a context without deadline; a
			// gateway that accepts and then says nothing must not hold
			// the request until the flight gives up.
			ctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			// A dialer per connection keeps hold of the TCP connection
			// under x/net's SOCKS5 wrapper, which hides CloseWrite (a
			// blind tunnel must pass a client's half-close on) and adds
			// only the bound address, which nothing here reads: once the
			// handshake is done, the tunnel is the gateway connection.
			raw := &rawDialer{d: k.dialer}
			cd, _ := socks5Dialer(pu, raw)
			if _, err := cd.DialContext(ctx, "tcp", addr); err != nil {
				if st := socksTargetStatus(err); st != 0 {
					err = &TargetUnreachableError{Target: addr, Status: st, Err: err}
				}
				return nil, &DialError{Op: "socks5 connect " + addr + " through session " + spec.id + " (" + pu.Host + ")", Err: err}
			}
			return k.idle(raw.conn), nil
		}
		s.net.init(func() *netTransports {
			nt := new(netTransports)
			nt.tls = k.transport(nt.counted(tunnel), nil, keepAlive, idleTimeout)
			nt.plain = nt.tls
			return nt
		})
		s.mirror = k.mirroredTransport(tunnel, true, keepAlive, idleTimeout)
	default:
		return nil, fmt.Errorf("session %s: unsupported scheme %q", spec.id, pu.Scheme)
	}
	return s, nil
}

// sessionSet is an immutable snapshot of the pool's sessions, replaced
// whole when a provider's list or the configuration changes: selection
// reads it without locks.
type sessionSet struct {
	list []*session // sorted by id
	byID map[string]*session
	// tiers are the sessions by their group's priority, highest first
	// (each sorted by id); byProvider each group's sessions.
	tiers      [][]*session
	byProvider map[*provider][]*session
}

// newSessionSet indexes list, whose sessions' groups are groups (sorted
// by priority, highest first).
func newSessionSet(list []*session, groups []*provider) *sessionSet {
	set := &sessionSet{list: list, byID: make(map[string]*session, len(list)), byProvider: map[*provider][]*session{}}
	for _, s := range list {
		set.byID[s.id] = s
		pv := s.prov.Load()
		set.byProvider[pv] = append(set.byProvider[pv], s)
	}
	for i := 0; i < len(groups); {
		j, tier := i, []*session(nil)
		for ; j < len(groups) && groups[j].priority == groups[i].priority; j++ {
			tier = append(tier, set.byProvider[groups[j]]...)
		}
		if len(tier) > 0 {
			sortSessions(tier)
			set.tiers = append(set.tiers, tier)
		}
		i = j
	}
	return set
}

// socks5Dialer builds x/net's SOCKS5 dialer for a gateway URL (credentials
// from its userinfo) over forward.
func socks5Dialer(pu *url.URL, forward xproxy.Dialer) (xproxy.ContextDialer, error) {
	d, err := xproxy.FromURL(pu, forward)
	if err != nil {
		return nil, err
	}
	cd, ok := d.(xproxy.ContextDialer)
	if !ok {
		return nil, errors.New("socks5 dialer does not support contexts")
	}
	return cd, nil
}

// maxSOCKSCredential is RFC 1929's bound on a SOCKS5 user name and on its
// password: each is sent after a one-byte length.
const maxSOCKSCredential = 255

// checkSOCKSCredentials refuses credentials no SOCKS5 gateway can be sent:
// x/net's client fails every connection with them before it leaves this
// host, and the session would be charged for each.
func checkSOCKSCredentials(user, pass string) error {
	if len(user) > maxSOCKSCredential || len(pass) > maxSOCKSCredential {
		return fmt.Errorf("SOCKS5 user name and password must be at most %d bytes each (RFC 1929), got %d and %d",
			maxSOCKSCredential, len(user), len(pass))
	}
	return nil
}

// rawDialer dials the gateway and remembers the connection it made.
type rawDialer struct {
	d    *net.Dialer
	conn net.Conn
}

func (r *rawDialer) Dial(network, addr string) (net.Conn, error) {
	return r.DialContext(context.Background(), network, addr)
}

func (r *rawDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	c, err := r.d.DialContext(ctx, network, addr)
	r.conn = c
	return c, err
}

// socksTargetReplies are the SOCKS5 replies (RFC 1928 §6) by which a gateway
// says it could not reach the target, or will not ("not allowed by
// ruleset": the provider's policy refuses it, as a 403 to CONNECT does),
// with the status the client is answered. x/net's client reports a reply
// only as the text "unknown error " + its name, inside the *net.OpError
// of the "socks connect".
var socksTargetReplies = map[string]int{
	"unknown error network unreachable":               http.StatusBadGateway,
	"unknown error host unreachable":                  http.StatusBadGateway,
	"unknown error connection refused":                http.StatusBadGateway,
	"unknown error TTL expired":                       http.StatusGatewayTimeout,
	"unknown error connection not allowed by ruleset": http.StatusBadGateway,
}

// socksTargetStatus returns the status of a TargetUnreachableError for a
// SOCKS5 CONNECT failure err, 0 when err is not a target-unreachable reply
// (the gateway could not be reached, refused our credentials, or failed
// by itself: "general SOCKS server failure").
func socksTargetStatus(err error) int {
	var oe *net.OpError
	if !errors.As(err, &oe) || oe.Op != "socks connect" || oe.Err == nil {
		return 0
	}
	return socksTargetReplies[oe.Err.Error()]
}
