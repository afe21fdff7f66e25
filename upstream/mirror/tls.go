package mirror

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	utls "github.com/bogdanfinn/utls"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
)

// Mode says how the hello a connection was opened with was made.
type Mode int

// The modes, from most to least faithful.
const (
	Mirrored Mode = iota + 1 // the client's hello
	Closest                  // the client's hello minus what the TLS library cannot complete
	Go                       // a default hello with the client's ALPN list
)

func (m Mode) String() string {
	switch m {
	case Mirrored:
		return "mirrored"
	case Closest:
		return "closest"
	case Go:
		return "go"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// A Report says how a connection's hello was made. Callers count Mode in a
// metric and log Changes at debug level.
type Report struct {
	Mode Mode
	// Changes says, in words, what the hello sent differs in from the
	// client's, beyond the fresh randoms, GREASE values and key shares.
	Changes []string
	// Verbatim lists the extensions sent as the client's bytes, without
	// logic behind them in the TLS library.
	Verbatim []uint16
	// Failed holds the handshake errors of the rungs tried before this one.
	Failed []error
}

// A Dialer opens TLS connections to origins with a client's hello. The
// zero value is not usable: Dial is required.
type Dialer struct {
	// Dial opens the connection the TLS session runs on: a TCP connection
	// to the origin, or a tunnel to it through an upstream gateway (HTTP
	// CONNECT, SOCKS5). A refused handshake costs another call.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)

	// TLSConfig supplies how the origin is verified: RootCAs,
	// InsecureSkipVerify, VerifyPeerCertificate, VerifyConnection, and
	// ServerName (if empty: the host of addr). NextProtos is offered only
	// by the Go hello of a client without a hello. Nothing else is read:
	// the hello is the client's. If nil, the system roots verify the
	// origin.
	TLSConfig *tls.Config

	// HandshakeTimeout bounds each handshake. If zero, 10 seconds.
	HandshakeTimeout time.Duration

	memo rungMemo
}

// DialTLS opens a TLS connection to addr, the origin's host:port, with a
// hello made from hello (nil when the client's did not parse: Go mode).
// The origin is verified for addr's host unless TLSConfig.ServerName says
// otherwise. network is "tcp" normally. A Dialer must not be copied after
// first use (it remembers which hellos origins refused).
func (d *Dialer) DialTLS(ctx context.Context, network, addr string, hello *fingerprint.ClientHello) (*Conn, error) {
	if d.Dial == nil {
		return nil, errors.New("mirror: Dialer.Dial is nil")
	}
	serverName := ""
	if d.TLSConfig != nil {
		serverName = d.TLSConfig.ServerName
	}
	if serverName == "" {
		host, _, err := net.SplitHostPort(addr)
		if err != nil {
			return nil, fmt.Errorf("mirror: %w", err)
		}
		serverName = host
	}
	var key memoKey
	r := Mirrored
	// keyGroup is the classical key share utls keeps the private key for
	// (0: the first). An origin that picks another one (Firefox offers
	// X25519 and P-256; a FIPS origin takes P-256) fails the mirrored
	// handshake on our side; the client's own hello gets through again
	// with the key on the next share, before any rung is given up.
	var keyGroup utls.CurveID
	var shares []utls.CurveID
	if hello == nil {
		r = Go
	} else {
		key = memoKey{id: fingerprint.New(hello, nil).ID(), server: serverName}
		if e := d.memo.get(key); e.mode > r {
			r = e.mode
		} else if e.mode == Mirrored {
			keyGroup = e.keyGroup
		}
		shares = classicalShares(hello)
		if keyGroup == 0 && len(shares) > 0 {
			keyGroup = shares[0]
		}
	}
	var failed []error
	tried := map[utls.CurveID]bool{}
	redialed := false // this rung's hello was cut once already
	for {
		raw, err := d.Dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		c, err := d.handshake(ctx, raw, hello, serverName, r, keyGroup)
		if err == nil {
			c.report.Failed = failed
			if hello != nil {
				e := memoEntry{mode: r}
				if r == Mirrored && len(shares) > 0 && keyGroup != shares[0] {
					e.keyGroup = keyGroup
				}
				d.memo.put(key, e)
			}
			return c, nil
		}
		raw.Close()
		if r == Go || !helloRefused(ctx, err) {
			return nil, err
		}
		if cutOff(err) && !redialed {
			// A handshake cut without a word may be the hello's
			// refusal, or a restart or an overloaded balancer: the
			// same hello once more before a downgrade, which the memo
			// would keep for memoTTL.
			redialed = true
			continue
		}
		redialed = false
		failed = append(failed, fmt.Errorf("%v hello: %w", r, err))
		tried[keyGroup] = true
		if r == Mirrored && strings.Contains(err.Error(), "invalid server key share") {
			if i := slices.IndexFunc(shares, func(g utls.CurveID) bool { return !tried[g] }); i >= 0 {
				keyGroup = shares[i]
				continue
			}
		}
		r++
	}
}

// helloRefused reports whether a handshake error may be the hello's fault,
// so that a less faithful one may succeed: not a certificate the origin's
// chain failed, not a cancelled context, not a handshake that timed out
// (an origin that says nothing has refused nothing: another hello would
// cost another HandshakeTimeout, and the memo would keep the downgrade for
// memoTTL).
func helloRefused(ctx context.Context, err error) bool {
	if ctx.Err() != nil {
		return false
	}
	if errors.Is(err, context.DeadlineExceeded) || timedOut(err) {
		return false
	}
	var ve *utls.CertificateVerificationError
	var ue verifyError
	var xe x509.UnknownAuthorityError
	var he x509.HostnameError
	var ie x509.CertificateInvalidError
	return !errors.As(err, &ve) && !errors.As(err, &ue) && !errors.As(err, &xe) &&
		!errors.As(err, &he) && !errors.As(err, &ie)
}

// cutOff reports a handshake the origin's side ended without an alert: a
// reset, or the connection closed.
func cutOff(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

// verifyError marks an error from the caller's verification callbacks.
type verifyError struct{ err error }

func (e verifyError) Error() string { return e.err.Error() }
func (e verifyError) Unwrap() error { return e.err }

func (d *Dialer) handshake(ctx context.Context, raw net.Conn, hello *fingerprint.ClientHello, serverName string, mode Mode, keyGroup utls.CurveID) (*Conn, error) {
	cfg := d.utlsConfig(serverName)
	var uc *utls.UConn
	w := &tlsWire{Conn: raw}
	report := Report{Mode: mode}
	if mode == Go {
		if hello != nil {
			cfg.NextProtos = hello.ALPN
		} else if d.TLSConfig != nil {
			cfg.NextProtos = d.TLSConfig.NextProtos
		}
		uc = utls.UClient(w, cfg, utls.HelloGolang, false, false, false)
	} else {
		spec, r, err := buildSpec(hello, serverName, mode, keyGroup)
		if err != nil {
			// utls cannot take the hello at all: the Go hello it is.
			c, gerr := d.handshake(ctx, raw, hello, serverName, Go, 0)
			if gerr != nil {
				return nil, gerr
			}
			c.report.Changes = append(c.report.Changes, "the client's hello does not parse in utls: "+err.Error())
			return c, nil
		}
		report = r
		// utls writes the hello's record with version 0x0301 whatever
		// the client's record said (Java's is 0x0303).
		w.version = hello.RecordVersion
		uc = utls.UClient(w, cfg, utls.HelloCustom, false, false, false)
		if err := uc.ApplyPreset(spec); err != nil {
			return nil, fmt.Errorf("mirror: apply hello: %w", err)
		}
		// ApplyPreset always makes up a 32-byte legacy_session_id; a
		// TLS-1.2-only OpenSSL client (curl --tls-max 1.2) sends none,
		// and the 32 bytes more would show in the hello's length. Fresh
		// bytes, as many as the client's. The hello is marshalled (and
		// padded) at the handshake, after this.
		sid := make([]byte, len(hello.SessionID))
		if _, err := rand.Read(sid); err != nil {
			return nil, fmt.Errorf("mirror: session id: %w", err)
		}
		uc.HandshakeState.Hello.SessionId = sid
	}
	timeout := d.HandshakeTimeout
	if timeout == 0 {
		timeout = 10 * time.Second
	}
	hctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := uc.HandshakeContext(hctx); err != nil {
		return nil, fmt.Errorf("mirror: %v TLS handshake with %s: %w", mode, serverName, err)
	}
	return &Conn{Conn: uc, uc: uc, raw: raw, wire: w, report: report}, nil
}

// tlsWire is the connection under a TLS session to an origin. It writes the
// hello's record with the client's record-layer version (utls writes
// 0x0301 whatever the client's record said; Java's is 0x0303), it lets
// the idle check ask the TLS layer for what it already read off the
// socket without a read deadline (see [Conn.readHeld]), and it follows
// the records it reads so that the check can tell when the TLS layer
// holds part of one (see [Conn.midRecord]).
type tlsWire struct {
	net.Conn
	version uint16 // the hello record's; 0 leaves utls's
	wrote   bool   // the hello went out
	in      recordFramer
	// mid is in.within() after the last read, for the idle check, which
	// runs on another goroutine than the reads before it.
	mid atomic.Bool
	// held refuses reads, as a read past its deadline fails, without
	// reaching the connection: setting and clearing a past deadline went
	// through utls, the idle-timeout wrapper and the runtime's poller,
	// a fifth of the look's cost (BenchmarkH1IdleCheck) and an
	// allocation per reused connection.
	held atomic.Bool
}

func (c *tlsWire) Write(p []byte) (int, error) {
	if !c.wrote {
		c.wrote = true
		if len(p) >= 5 && p[0] == 22 && p[1] == 3 && c.version>>8 == 3 {
			q := append([]byte(nil), p...)
			q[1], q[2] = byte(c.version>>8), byte(c.version)
			return c.Conn.Write(q)
		}
	}
	return c.Conn.Write(p)
}

// Read fails with os.ErrDeadlineExceeded while held. The TLS layer takes
// that error, as a deadline's, for a temporary one: the session stays
// usable, and a record it had begun to read stays where it was.
func (c *tlsWire) Read(p []byte) (int, error) {
	if c.held.Load() {
		return 0, os.ErrDeadlineExceeded
	}
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.in.feed(p[:n])
		c.mid.Store(c.in.within())
	}
	return n, err
}

// recordFramer follows the TLS records in a stream of bytes read: a
// header of 5 bytes whose last two give the length of the body behind
// it. Only framing: a record's type and content are the TLS layer's.
type recordFramer struct {
	head int // the header bytes seen of the record begun, 0 to 4
	size int // its body's length, as far as the header has come
	left int // the body bytes of the current record still to come
}

func (f *recordFramer) feed(b []byte) {
	for len(b) > 0 {
		if f.left > 0 {
			n := min(f.left, len(b))
			f.left -= n
			b = b[n:]
			continue
		}
		switch f.head {
		case 3:
			f.size = int(b[0]) << 8
		case 4:
			f.size |= int(b[0])
		}
		f.head++
		b = b[1:]
		if f.head == 5 {
			f.head, f.left = 0, f.size
		}
	}
}

// within reports whether the bytes fed so far stop inside a record.
func (f *recordFramer) within() bool { return f.head > 0 || f.left > 0 }

// Unwrap returns the connection under it, for socketOf.
func (c *tlsWire) Unwrap() net.Conn { return c.Conn }

// utlsConfig is a fresh utls configuration per dial (ApplyPreset writes
// the ALPN list into it) carrying the caller's verification.
func (d *Dialer) utlsConfig(serverName string) *utls.Config {
	cfg := &utls.Config{ServerName: serverName}
	t := d.TLSConfig
	if t == nil {
		return cfg
	}
	cfg.RootCAs = t.RootCAs
	cfg.InsecureSkipVerify = t.InsecureSkipVerify
	if f := t.VerifyPeerCertificate; f != nil {
		cfg.VerifyPeerCertificate = func(raw [][]byte, chains [][]*x509.Certificate) error {
			if err := f(raw, chains); err != nil {
				return verifyError{err}
			}
			return nil
		}
	}
	if f := t.VerifyConnection; f != nil {
		cfg.VerifyConnection = func(cs utls.ConnectionState) error {
			if err := f(stdState(cs)); err != nil {
				return verifyError{err}
			}
			return nil
		}
	}
	return cfg
}

// A Conn is a TLS connection to an origin opened with a client's hello.
type Conn struct {
	net.Conn
	uc     *utls.UConn
	raw    net.Conn // the connection the TLS session runs on
	wire   *tlsWire // raw, as the TLS session sees it
	report Report
}

// Report says how the connection's hello was made.
func (c *Conn) Report() Report { return c.report }

// ConnectionState returns the TLS state, in crypto/tls's terms.
func (c *Conn) ConnectionState() tls.ConnectionState { return stdState(c.uc.ConnectionState()) }

// NetConn returns the connection the TLS session runs on.
func (c *Conn) NetConn() net.Conn { return c.raw }

// readHeld reads what the TLS layer holds already, never the connection
// under it: records it read off the socket ahead of the last read (data
// or a close_notify sent right behind a response, a session ticket; in
// TLS 1.3 every record looks like data from outside, so the layer reads
// on only when asked) are gone through, and what they carry is returned
// (data, io.EOF for a close_notify, an error). With nothing held it fails
// at once with an error that matches os.ErrDeadlineExceeded, as a Read
// past its deadline would, and the connection stays usable.
//
// Only an HTTP/1.1 connection's idle check calls it, while nothing else
// reads the connection: a read running alongside would find the wire
// held and fail.
//
// The connection under the TLS layer may have had bytes of its own read
// ahead (a tunnel's, before the handshake), which readHeld does not see:
// readahead.Conn hands those out before it reads its socket, so the
// handshake and the responses since have taken them.
func (c *Conn) readHeld(p []byte) (int, error) {
	c.wire.held.Store(true)
	defer c.wire.held.Store(false)
	return c.uc.Read(p)
}

// midRecord reports whether the reads off the connection so far stopped
// inside a TLS record: the TLS layer holds the start of a record whose
// rest has not arrived. On an idle connection that is the start of
// something nobody asked for, which a read that gives up in time, or
// the held read, leaves in the TLS layer and off the socket, where the
// idle check's peek no longer sees it.
func (c *Conn) midRecord() bool { return c.wire.mid.Load() }

func stdState(s utls.ConnectionState) tls.ConnectionState {
	return tls.ConnectionState{
		Version:                     s.Version,
		HandshakeComplete:           s.HandshakeComplete,
		DidResume:                   s.DidResume,
		CipherSuite:                 s.CipherSuite,
		NegotiatedProtocol:          s.NegotiatedProtocol,
		ServerName:                  s.ServerName,
		PeerCertificates:            s.PeerCertificates,
		VerifiedChains:              s.VerifiedChains,
		SignedCertificateTimestamps: s.SignedCertificateTimestamps,
		OCSPResponse:                s.OCSPResponse,
	}
}

// rungMemo remembers, per hello and server, the first mode that
// completed, so one refusal does not cost a redial on every connection. An
// entry expires after memoTTL: the origin may have changed its mind.
type rungMemo struct {
	mu sync.Mutex
	m  map[memoKey]memoEntry
}

type memoEntry struct {
	mode     Mode
	keyGroup utls.CurveID // Mirrored: the key share the origin picks, when not the first classical one
	at       time.Time
}

const memoTTL = time.Hour

type memoKey struct {
	id     fingerprint.ID
	server string
}

// maxMemo bounds the memo; past it an arbitrary entry makes room (a
// forgotten entry costs one redial, never a failure).
const maxMemo = 4096

func (m *rungMemo) get(k memoKey) memoEntry {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.m[k]
	if !ok || time.Since(e.at) > memoTTL {
		return memoEntry{}
	}
	return e
}

func (m *rungMemo) put(k memoKey, e memoEntry) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if e.mode == Mirrored && e.keyGroup == 0 {
		delete(m.m, k)
		return
	}
	if m.m == nil {
		m.m = make(map[memoKey]memoEntry)
	}
	if _, ok := m.m[k]; !ok && len(m.m) >= maxMemo {
		for old := range m.m {
			delete(m.m, old)
			break
		}
	}
	e.at = time.Now()
	m.m[k] = e
}
