// Package connlimit is a front door's view of its listening socket: it caps
// the number of live client connections, and the share one client may
// hold, gives each an idle deadline, and keeps track of them so that a
// shutdown can cut the ones no server tracks any more (hijacked CONNECT
// tunnels, MITM sessions, WebSockets, SOCKS5 tunnels). The HTTP proxy port
// and the SOCKS5 port each serve on one.
//
// Near the cap it sheds idle connections, longest idle first, so that
// silent tunnels (a CONNECT and then nothing, thousands of them) cannot
// lock new clients out; a client at its own cap likewise gives up its
// idlest connection rather than being refused a new one. A connection its
// server marks busy (a request being served) or that moved bytes within
// the last second is never shed.
package connlimit

import (
	"cmp"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/halfclose"
	"github.com/seed-a3c387e8/onceproxy/internal/httpstatus"
	"github.com/seed-a3c387e8/onceproxy/internal/idleconn"
)

// Config is what a Listener enforces.
type Config struct {
	// MaxConns caps live client connections; beyond it, new clients wait
	// in the kernel's backlog. Required (at least 1).
	MaxConns int
	// IdleTimeout closes a connection on which nothing moved for this
	// long (see idleconn); 0 means none.
	IdleTimeout time.Duration
	// MaxPerClient caps the live connections of one client: its address
	// when accepted, its account once Attribute names it. 0 means no cap.
	MaxPerClient int
	// RefuseInProtocol hands a connection over its client's cap to the
	// server, marked (see OverCap), instead of answering it with an HTTP
	// 429 and closing it: a SOCKS5 client cannot parse HTTP, and its
	// refusal (05 FF) must follow the greeting it sends first. The
	// connection holds its slot until the server closes it.
	RefuseInProtocol bool
}

// shedIdle is how long a connection must have moved nothing, and not be
// busy, before it may be shed.
const shedIdle = time.Second

// Listener wraps a net.Listener with the limits of Config.
type Listener struct {
	net.Listener
	cfg  Config
	sem  chan struct{}
	done chan struct{} // closed by Close: stops an Accept waiting for a slot
	stop sync.Once

	mu      sync.Mutex
	conns   map[*conn]struct{}
	clients map[string]int // live connections per client key
	closed  bool           // CloseAll ran: every connection accepted later is refused

	shed    atomic.Int64 // connections shed to make room
	refused atomic.Int64 // connections refused by the per-client cap
}

// New returns ln with cfg's limits.
func New(ln net.Listener, cfg Config) *Listener {
	return &Listener{
		Listener: ln,
		cfg:      cfg,
		sem:      make(chan struct{}, max(cfg.MaxConns, 1)),
		done:     make(chan struct{}),
		conns:    make(map[*conn]struct{}),
		clients:  make(map[string]int),
	}
}

// highWater is the number of live connections above which idle ones are
// shed: a sixteenth of the slots is kept for new clients while there are
// idle connections to give way.
func (l *Listener) highWater() int {
	return l.cfg.MaxConns - max(l.cfg.MaxConns/16, 1)
}

// Accept waits for a free connection slot before accepting, so that beyond
// MaxConns new clients queue in the kernel's backlog instead of costing a
// goroutine and a buffer each. A connection gives its slot back when it is
// closed.
func (l *Listener) Accept() (net.Conn, error) {
	for {
		tc, err := l.accept()
		if tc != nil || err != nil {
			return tc, err
		}
		// The client was over its cap and has been told: next.
	}
}

// accept takes one connection. It returns nil, nil for a connection it
// refused (its client over MaxPerClient).
func (l *Listener) accept() (net.Conn, error) {
	if !l.acquire() {
		return nil, net.ErrClosed
	}
	c, err := l.Listener.Accept()
	if err != nil {
		<-l.sem
		return nil, err
	}
	tc := &conn{Conn: halfclose.Conn{Conn: idleconn.Wrap(c, l.cfg.IdleTimeout)}, l: l, key: addrKey(c.RemoteAddr())}
	tc.last.Store(time.Now().UnixNano())
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		c.Close()
		<-l.sem
		return nil, net.ErrClosed
	}
	l.conns[tc] = struct{}{}
	l.clients[tc.key]++
	over := l.cfg.MaxPerClient > 0 && l.clients[tc.key] > l.cfg.MaxPerClient
	var victims []*conn
	switch {
	case over:
		// A client that opens a connection per request and leaves each
		// idle gives its idlest one up instead of being refused.
		if victims = l.idlestLocked(1, tc.key); len(victims) > 0 {
			over = false
		}
	case len(l.conns) > l.highWater():
		victims = l.idlestLocked(len(l.conns)-l.highWater(), "")
	}
	l.mu.Unlock()
	l.shedAll(victims)
	if over {
		l.refused.Add(1)
		if l.cfg.RefuseInProtocol {
			tc.overCap = l.cfg.MaxPerClient
			return tc, nil
		}
		refuse(c, l.cfg.MaxPerClient)
		tc.Close()
		return nil, nil
	}
	return tc, nil
}

// acquire waits for a connection slot; false once the listener is closed.
//
// Shedding happens as a connection is accepted, and a full listener
// accepts none: connections that took every slot at once (a burst of
// CONNECTs) were too fresh to shed then, and would keep new clients out
// until their idle timeout once they went silent. So while every slot is
// taken, the connections above the high-water mark that have since gone
// idle are shed, as the next accept would have.
func (l *Listener) acquire() bool {
	select {
	case l.sem <- struct{}{}:
		return true
	case <-l.done:
		return false
	default:
	}
	t := time.NewTicker(shedIdle)
	defer t.Stop()
	for {
		select {
		case l.sem <- struct{}{}:
			return true
		case <-l.done:
			return false
		case <-t.C:
			l.mu.Lock()
			var victims []*conn
			if n := len(l.conns) - l.highWater(); n > 0 {
				victims = l.idlestLocked(n, "")
			}
			l.mu.Unlock()
			l.shedAll(victims)
		}
	}
}

// refuse tells a client over its connection cap why, in HTTP, briefly:
// the connection is closed right after.
func refuse(c net.Conn, max int) {
	_ = c.SetWriteDeadline(time.Now().Add(time.Second))
	msg := fmt.Sprintf("onceproxy: 429 too many connections from this client (proxy.max_conns_per_client = %d)\n", max)
	_, _ = fmt.Fprintf(c, "HTTP/1.1 %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nConnection: close\r\nX-Onceproxy-Error: too_many_connections\r\n\r\n%s",
		httpstatus.Line(http.StatusTooManyRequests), len(msg), msg)
}

// idlestLocked picks up to n connections to shed, of client key (any
// client for ""): neither busy nor active within shedIdle, longest idle
// first. Caller holds mu, and must shed them (shedAll).
//
// A picked connection is marked so that no other caller picks it while
// it is being closed (outside mu): each victim makes room once. Two
// connections of a client at its cap would otherwise both take the place
// of its one idle connection, and leave the client over its cap.
func (l *Listener) idlestLocked(n int, key string) []*conn {
	cutoff := time.Now().Add(-shedIdle).UnixNano()
	var idle []*conn
	for c := range l.conns {
		if !c.shed && !c.busy.Load() && c.last.Load() < cutoff && (key == "" || c.key == key) {
			idle = append(idle, c)
		}
	}
	slices.SortFunc(idle, func(a, b *conn) int { return cmp.Compare(a.last.Load(), b.last.Load()) })
	idle = idle[:min(n, len(idle))]
	for _, c := range idle {
		c.shed = true
	}
	return idle
}

// Stats are a listener's counts, for metrics.
type Stats struct {
	Live, Shed, Refused int64
}

// Add returns the sum of s and o: the counts of several listeners.
func (s Stats) Add(o Stats) Stats {
	return Stats{Live: s.Live + o.Live, Shed: s.Shed + o.Shed, Refused: s.Refused + o.Refused}
}

// Stats returns the listener's counts.
func (l *Listener) Stats() Stats {
	return Stats{Live: int64(l.Len()), Shed: l.shed.Load(), Refused: l.refused.Load()}
}

// addrKey is the client key of a remote address: its IP.
func addrKey(a net.Addr) string {
	if ta, ok := a.(*net.TCPAddr); ok {
		return "ip:" + ta.AddrPort().Addr().Unmap().String()
	}
	return "ip:" + a.String()
}

// find returns the listener connection under c's wrappers (TLS, read-ahead,
// the proxy's own), or nil.
func find(c net.Conn) *conn {
	for c != nil {
		switch x := c.(type) {
		case *conn:
			return x
		case *tls.Conn:
			c = x.NetConn()
		case interface{ Unwrap() net.Conn }:
			c = x.Unwrap()
		default:
			return nil
		}
	}
	return nil
}

// OverCap returns the cap the client of c was over when c was accepted by
// a RefuseInProtocol listener, which the server must refuse; 0 for any
// other connection.
func OverCap(c net.Conn) int {
	if tc := find(c); tc != nil {
		return tc.overCap
	}
	return 0
}

// SetBusy marks the listener connection under c as serving a request (never
// shed) or not. Servers call it from their ConnState hook.
func SetBusy(c net.Conn, busy bool) {
	if tc := find(c); tc != nil {
		tc.busy.Store(busy)
	}
}

// ConnState is the http.Server ConnState hook of a server on a Listener:
// a connection serving a request is never shed to make room, an idle one
// may be.
func ConnState(c net.Conn, st http.ConnState) { SetBusy(c, st == http.StateActive) }

// ErrTooManyConns is Attribute's refusal: the client already holds its cap.
var ErrTooManyConns = errors.New("too many connections from this client")

// Attribute counts the listener connection under c against client (an
// account the front door authenticated) instead of its address. It fails
// with ErrTooManyConns when that client already holds MaxPerClient
// connections; the caller refuses and closes.
//
// A client at its cap with a connection idle for a while (neither serving
// a request nor moving bytes within shedIdle) gives that one up instead:
// a scraper that opens a connection per request and leaves the old ones
// idle is not refused until they time out.
func Attribute(c net.Conn, client string) error {
	tc := find(c)
	if tc == nil || client == "" {
		return nil
	}
	l := tc.l
	l.mu.Lock()
	if tc.key == client {
		l.mu.Unlock()
		return nil
	}
	var victims []*conn
	if l.cfg.MaxPerClient > 0 && l.clients[client] >= l.cfg.MaxPerClient {
		if victims = l.idlestLocked(1, client); len(victims) == 0 {
			l.mu.Unlock()
			l.refused.Add(1)
			return fmt.Errorf("%w (proxy.max_conns_per_client = %d)", ErrTooManyConns, l.cfg.MaxPerClient)
		}
	}
	if _, live := l.conns[tc]; live {
		l.release(tc.key)
		l.clients[client]++
	}
	tc.key = client
	l.mu.Unlock()
	l.shedAll(victims)
	return nil
}

// shedAll closes the connections idlestLocked picked, counted as shed.
// Outside mu: Close gives a connection's slot back under it.
func (l *Listener) shedAll(victims []*conn) {
	for _, v := range victims {
		l.shed.Add(1)
		v.Close()
	}
}

// release drops one connection of key. Caller holds mu.
func (l *Listener) release(key string) {
	if l.clients[key]--; l.clients[key] <= 0 {
		delete(l.clients, key)
	}
}

// Close stops accepting; live connections are left alone (see CloseAll).
func (l *Listener) Close() error {
	l.stop.Do(func() { close(l.done) })
	return l.Listener.Close()
}

// Len returns the number of live client connections.
func (l *Listener) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.conns)
}

// CloseAll cuts every live connection: the last step of a shutdown, after
// the grace period for in-flight requests.
func (l *Listener) CloseAll() {
	l.mu.Lock()
	l.closed = true
	conns := make([]*conn, 0, len(l.conns))
	for c := range l.conns {
		conns = append(conns, c)
	}
	l.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
}

// conn is a client connection of a Listener; Close gives its slot back.
type conn struct {
	halfclose.Conn // half-close passes through: tunnels forward a client's EOF

	l    *Listener
	key  string       // the client it counts against; guarded by l.mu
	shed bool         // picked to be shed (idlestLocked); guarded by l.mu
	last atomic.Int64 // unix nanos of the last byte moved
	busy atomic.Bool  // its server is serving a request on it
	once sync.Once

	overCap int // the per-client cap it was over when accepted (RefuseInProtocol); 0 if none
}

func (c *conn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.last.Store(time.Now().UnixNano())
	}
	return n, err
}

func (c *conn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if n > 0 {
		c.last.Store(time.Now().UnixNano())
	}
	return n, err
}

func (c *conn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		c.l.mu.Lock()
		delete(c.l.conns, c)
		c.l.release(c.key)
		c.l.mu.Unlock()
		<-c.l.sem
	})
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}
