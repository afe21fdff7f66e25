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
	for {
		n, err := fingerprint.HelloRecordsLen(buf)
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
		need := 5 // a record header, then its body
		if len(buf) >= 5 {
			need = recordEnd(buf) - len(buf)
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

// recordEnd returns the offset where the last (incomplete) record in buf
// ends, or the offset of the next record header when buf ends between
// records. buf holds whole records, then at least one header's first byte.
func recordEnd(buf []byte) int {
	off := 0
	for {
		if len(buf)-off < 5 {
			return off + 5
		}
		end := off + 5 + (int(buf[off+3])<<8 | int(buf[off+4]))
		if end > len(buf) {
			return end
		}
		off = end
	}
}
