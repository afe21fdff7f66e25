package socks

import (
	"bufio"
	"errors"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
)

// sniffKind is what the first bytes of a client stream say it is.
type sniffKind int

const (
	sniffOther  sniffKind = iota // neither TLS nor HTTP: tunnel it
	sniffTLS                     // a TLS record: intercept
	sniffHTTP                    // an HTTP/1 request line or the h2c preface: intercept
	sniffSilent                  // nothing decisive before the sniff deadline (or the upstream spoke first)
	sniffClosed                  // the client hung up or failed before sending a byte
)

func (k sniffKind) String() string {
	return [...]string{"other", "tls", "http", "silent", "closed"}[k]
}

// maxMethodLen is the longest request method we wait for before deciding a
// stream is not HTTP; registered methods are at most 17 bytes
// ("BASELINE-CONTROL" is 16).
const maxMethodLen = 20

// recordTypeHandshake starts every TLS stream (a ClientHello record).
const recordTypeHandshake = 0x16

// classifyStream looks at a stream's first bytes. more reports that b is a
// plausible method so far and the decision needs more bytes.
func classifyStream(b []byte) (k sniffKind, more bool) {
	if len(b) == 0 {
		return sniffSilent, true
	}
	if b[0] == recordTypeHandshake {
		return sniffTLS, false
	}
	for i, c := range b {
		switch {
		case c == ' ' && i > 0:
			return classifyTarget(b[i+1:])
		case i >= maxMethodLen, !(c >= 'A' && c <= 'Z' || c == '-' || c == '_'):
			return sniffOther, false
		}
	}
	return sniffOther, true
}

// classifyTarget looks at what follows a method and a space: an HTTP
// request target ("/path", "*" of "PRI * HTTP/2.0" or OPTIONS, or an
// absolute "http://" or "https://" URL) makes the stream HTTP. Other text
// protocols where the client speaks first also begin with an upper-case
// word and a space (IRC's "NICK name", Redis's "AUTH secret"): they are
// tunnelled, not given to an HTTP server that would never answer them.
func classifyTarget(b []byte) (k sniffKind, more bool) {
	if len(b) == 0 {
		return sniffOther, true
	}
	if b[0] == '/' || b[0] == '*' {
		return sniffHTTP, false
	}
	for _, scheme := range []string{"http://", "https://"} {
		n := min(len(b), len(scheme))
		if strings.EqualFold(string(b[:n]), scheme[:n]) {
			if n == len(scheme) {
				return sniffHTTP, false
			}
			return sniffOther, true // a prefix of it so far
		}
	}
	return sniffOther, false
}

// sniff waits up to timeout (0: only the connection's idle deadline), or
// until the sniffer is interrupted, for enough of the client's first bytes
// to classify the stream. Nothing is consumed: every byte stays in r for
// whoever handles the stream.
func sniff(r *bufio.Reader, sn *sniffer, timeout time.Duration) sniffKind {
	sn.start(timeout)
	defer sn.end()
	n := 1
	for {
		b, err := r.Peek(n)
		k, more := classifyStream(b)
		if !more {
			return k
		}
		if err != nil {
			switch {
			case errors.Is(err, os.ErrDeadlineExceeded):
				// Silent, or stopped in the middle of a plausible first
				// word: "GE" at the deadline may be a slow HTTP client,
				// for the sniff after the dial to decide, not two bytes
				// to tunnel blind on.
				return sniffSilent
			case len(b) > 0:
				return sniffOther // the start of a word, then EOF or a failure
			default:
				return sniffClosed
			}
		}
		// Look at everything that has arrived before asking for more.
		if r.Buffered() > n {
			n = r.Buffered()
			continue
		}
		n++
	}
}

// sniffer owns the read deadline of a client connection while it is
// sniffed, so that another goroutine (the upstream speaking first) can cut
// the wait short without racing the deadline reset that follows it. An
// interrupt that comes before the sniff starts (the upstream's banner can
// arrive before the sniffing goroutine gets there) is remembered: losing it
// would leave both sides waiting for the other to speak.
type sniffer struct {
	conn        net.Conn
	mu          sync.Mutex
	active      bool
	interrupted bool
}

var pastDeadline = time.Unix(1, 0)

func (s *sniffer) start(timeout time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.active = true
	switch {
	case s.interrupted:
		_ = s.conn.SetReadDeadline(pastDeadline)
	case timeout > 0:
		_ = s.conn.SetReadDeadline(time.Now().Add(timeout))
	}
}

func (s *sniffer) end() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.active = false
	_ = s.conn.SetReadDeadline(time.Time{})
}

// interrupt ends a sniff in progress, or the next one, at once.
func (s *sniffer) interrupt() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.interrupted = true
	if s.active {
		_ = s.conn.SetReadDeadline(pastDeadline)
	}
}

// firstRead is the upstream's first read, made while the client is
// sniffed: a server-speaks-first protocol (SMTP, FTP, SSH banners, MySQL)
// then decides the matter without waiting for the sniff timeout.
type firstRead struct {
	b   []byte
	err error
}

// watchFirstRead starts reading up in the background; the result arrives
// on the returned channel (buffered: the reader never blocks on it) and
// interrupts sn. The goroutine ends with that read: the caller either
// consumes the result (firstReader) or closes up and then receives it.
func watchFirstRead(up net.Conn, sn *sniffer) <-chan firstRead {
	ch := make(chan firstRead, 1)
	go func() {
		buf := make([]byte, 32<<10)
		n, err := up.Read(buf)
		sn.interrupt()
		ch <- firstRead{buf[:n], err}
	}()
	return ch
}

// firstReader reads the upstream through its pending first read.
type firstReader struct {
	up      net.Conn
	first   <-chan firstRead
	got     bool
	pending []byte
	err     error
}

func (r *firstReader) Read(p []byte) (int, error) {
	if !r.got {
		fr := <-r.first
		r.got, r.pending, r.err = true, fr.b, fr.err
	}
	if len(r.pending) > 0 {
		n := copy(p, r.pending)
		r.pending = r.pending[n:]
		return n, nil
	}
	if r.err != nil {
		err := r.err
		r.err = nil
		return 0, err
	}
	return r.up.Read(p)
}

// HTTPStart reports whether b, the first bytes of a client stream that is
// not TLS, start an HTTP/1 request or the h2c preface; decided is false
// while more bytes are needed to tell. The HTTP proxy's CONNECT tunnels
// use it to send every other protocol through blind, as this door does.
func HTTPStart(b []byte) (isHTTP, decided bool) {
	k, more := classifyStream(b)
	return k == sniffHTTP, !more
}

// BlindHello reports whether a TLS stream whose client sent hello (nil:
// it did not parse) goes to its target blind instead of into the MITM:
// a client that offers protocols, none of them HTTP (MQTT, IMAP,
// PostgreSQL's direct TLS, ACME's tls-alpn-01), has nothing for the MITM
// to serve; and a fully qualified SNI ("example.com.") is refused by
// crypto/tls (RFC 6066 wants no trailing dot), though origins take it.
// It is the one rule for both doors: the HTTP proxy's tunnels decide with
// it, and this door, which has dialled already on a port outside
// mitm_ports, decides with it before handing the stream over, so that the
// tunnel keeps that dial instead of making another.
func BlindHello(hello *fingerprint.ClientHello) bool {
	return hello != nil && (strings.HasSuffix(hello.ServerName, ".") || !offersHTTP(hello))
}

// offersHTTP reports whether a client whose hello is hello may speak HTTP
// in its tunnel: it offers no protocol at all (ALPN is optional), or an
// HTTP one among those it offers.
func offersHTTP(hello *fingerprint.ClientHello) bool {
	if len(hello.ALPN) == 0 {
		return true
	}
	for _, p := range hello.ALPN {
		if p == "h2" || strings.HasPrefix(p, "http/") {
			return true
		}
	}
	return false
}
