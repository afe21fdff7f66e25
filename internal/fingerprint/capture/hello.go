// Package capture reads a client's fingerprint off a live connection on the
// server side: the raw ClientHello before crypto/tls consumes it, and the
// decrypted HTTP/2 preface and per-request header order while an
// http.Server reads the requests. Go's servers expose neither (a
// tls.ClientHelloInfo has no raw bytes, an http.Request no header order).
//
// Use it in this order on an accepted connection:
//
//	conn, hello, err := capture.PeekClientHello(raw) // err: hello is nil, conn still replays every byte
//	tlsConn := tls.Server(conn, cfg)                   // cfg.SessionTicketsDisabled: see below
//	// after the handshake:
//	tap := capture.NewConn(tlsConn, hello)            // serve tap with an http.Server (h1 and h2c)
//	// in the handler:
//	shape := tap.Shape(r)                              // this request's header order
//	fp := tap.Fingerprint()                            // hello + HTTP/2 preface
//
// The tap only reads: it never changes a byte the server sees. Because it
// is not a *tls.Conn, net/http does not pick HTTP/2 by ALPN on it: enable
// Protocols.SetHTTP2 and SetUnencryptedHTTP2 and it recognizes the HTTP/2
// preface by itself, so one http.Server serves tapped connections of both
// protocols.
//
// A server that wants to replay the hello must not issue session tickets
// (tls.Config.SessionTicketsDisabled): a client resuming would put the
// server's ticket into its next hello, and a mirrored hello has no use for
// it.
package capture

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/readahead"
)

// PeekClientHello reads the TLS records of the ClientHello from c and
// returns a connection that replays every byte it read, then reads c, with
// the parsed hello. Records are read whole (io.ReadFull on each length):
// a post-quantum hello is about 1.8 KiB and may span records.
//
// On any error (not TLS, a malformed or oversized hello, a read error) the
// hello is nil but the returned connection still replays what was read,
// so the caller can go on without a fingerprint. Set a read deadline on c
// first: a client that sends nothing would hold this call.
func PeekClientHello(c net.Conn) (net.Conn, *fingerprint.ClientHello, error) {
	buf := make([]byte, 0, 2048)
	var scan fingerprint.HelloScanner
	next := 0 // where the record being read starts
	for {
		n, err := scan.Scan(buf)
		if err != nil {
			return readahead.New(c, buf), nil, fmt.Errorf("capture: read ClientHello: %w", err)
		}
		if n > 0 {
			h, err := fingerprint.ParseClientHello(buf[:n])
			if err != nil {
				return readahead.New(c, buf), nil, fmt.Errorf("capture: read ClientHello: %w", err)
			}
			return readahead.New(c, buf), h, nil
		}
		// A record header, then its body. The reads are exact, so buf
		// ends at next or just past next's header; Scan has checked the
		// header's length. (Finding the record's end by walking buf from
		// its start, on every read, was quadratic in the records.)
		need := recordHeaderLen
		if len(buf) > next {
			next += recordHeaderLen + int(binary.BigEndian.Uint16(buf[next+3:]))
			need = next - len(buf)
		}
		if len(buf)+need > fingerprint.MaxHelloLen+1024 {
			return readahead.New(c, buf), nil, errors.New("capture: read ClientHello: too large")
		}
		buf = append(buf, make([]byte, need)...)
		k, err := io.ReadFull(c, buf[len(buf)-need:])
		buf = buf[:len(buf)-need+k]
		if err != nil {
			return readahead.New(c, buf), nil, fmt.Errorf("capture: read ClientHello: %w", err)
		}
	}
}

// recordHeaderLen is a TLS record header's length: type, version, length.
const recordHeaderLen = 5
