package mirror

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"io"
	"net"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	utls "github.com/bogdanfinn/utls"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/capture"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/fporigin"
)

// helloFrom captures the ClientHello handshake sends on a pipe.
func helloFrom(t testing.TB, handshake func(net.Conn) error) *fingerprint.ClientHello {
	t.Helper()
	cli, srv := net.Pipe()
	go func() {
		handshake(cli) // fails once srv closes: only the hello matters
		cli.Close()
	}()
	_, h, err := capture.PeekClientHello(srv)
	srv.Close()
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// goHello is Go's crypto/tls hello for localhost offering protos.
func goHello(t testing.TB, protos ...string) *fingerprint.ClientHello {
	return helloFrom(t, func(c net.Conn) error {
		return tls.Client(c, &tls.Config{ServerName: "localhost", NextProtos: protos}).Handshake()
	})
}

// chromeHello is utls's Chrome 133 parrot: GREASE, ALPS, GREASE ECH, cert
// compression, an X25519MLKEM768 key share, shuffled extensions.
func chromeHello(t testing.TB) *fingerprint.ClientHello {
	return helloFrom(t, func(c net.Conn) error {
		return utls.UClient(c, &utls.Config{ServerName: "localhost"}, utls.HelloChrome_133, false, false, false).Handshake()
	})
}

// firefoxHello is utls's Firefox 120 parrot: record_size_limit, delegated
// credentials, three key shares.
func firefoxHello(t testing.TB) *fingerprint.ClientHello {
	return helloFrom(t, func(c net.Conn) error {
		return utls.UClient(c, &utls.Config{ServerName: "localhost"}, utls.HelloFirefox_120, false, false, false).Handshake()
	})
}

// rebuild returns h with its extensions replaced, re-encoded and parsed.
func rebuild(t testing.TB, h *fingerprint.ClientHello, exts []fingerprint.Extension) *fingerprint.ClientHello {
	t.Helper()
	var body []byte
	body = binary.BigEndian.AppendUint16(body, h.Version)
	body = append(body, h.Random...)
	body = append(body, byte(len(h.SessionID)))
	body = append(body, h.SessionID...)
	body = binary.BigEndian.AppendUint16(body, uint16(2*len(h.CipherSuites)))
	for _, c := range h.CipherSuites {
		body = binary.BigEndian.AppendUint16(body, c)
	}
	body = append(body, byte(len(h.CompressionMethods)))
	body = append(body, h.CompressionMethods...)
	var e []byte
	for _, x := range exts {
		e = binary.BigEndian.AppendUint16(e, x.Type)
		e = binary.BigEndian.AppendUint16(e, uint16(len(x.Data)))
		e = append(e, x.Data...)
	}
	body = binary.BigEndian.AppendUint16(body, uint16(len(e)))
	body = append(body, e...)
	msg := append([]byte{1, byte(len(body) >> 16), byte(len(body) >> 8), byte(len(body))}, body...)
	rec := append([]byte{22, 3, 1, byte(len(msg) >> 8), byte(len(msg))}, msg...)
	out, err := fingerprint.ParseClientHello(rec)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// extTypes lists the hello's extension types with GREASE values marked.
func extTypes(h *fingerprint.ClientHello) []uint16 {
	var out []uint16
	for _, x := range h.Extensions {
		if fingerprint.IsGREASE(x.Type) {
			out = append(out, 0x0a0a)
		} else {
			out = append(out, x.Type)
		}
	}
	return out
}

func startOrigin(t *testing.T, opts fporigin.Options) *fporigin.Origin {
	t.Helper()
	o, err := fporigin.Start(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { o.Close() })
	return o
}

// countingDialer dials loopback and counts the dials.
type countingDialer struct{ n atomic.Int32 }

func (d *countingDialer) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	d.n.Add(1)
	var nd net.Dialer
	return nd.DialContext(ctx, network, addr)
}

func newDialer(o *fporigin.Origin, cd *countingDialer) *Dialer {
	return &Dialer{Dial: cd.dial, TLSConfig: &tls.Config{RootCAs: o.CertPool(), ServerName: "localhost"}}
}

func ctxTimeout(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// openConn dials o with hello and starts HTTP on what ALPN chose.
func openConn(t *testing.T, o *fporigin.Origin, hello *fingerprint.ClientHello, pre *fingerprint.H2, opts Options) (ClientConn, *Conn) {
	t.Helper()
	var cd countingDialer
	c, err := newDialer(o, &cd).DialTLS(ctxTimeout(t, 10*time.Second), "tcp", o.Addr(), hello)
	if err != nil {
		t.Fatal(err)
	}
	cc, err := NewClientConn(c, c.ConnectionState().NegotiatedProtocol, pre, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc, c
}

func newRequest(t testing.TB, ctx context.Context, method, url string, shape *fingerprint.Shape) *http.Request {
	t.Helper()
	if shape != nil {
		ctx = fingerprint.WithShape(ctx, shape)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	return req
}

// chromeH2 is Chrome's HTTP/2 preface.
var chromeH2 = &fingerprint.H2{
	Settings:       []fingerprint.Setting{{ID: 1, Val: 65536}, {ID: 2, Val: 0}, {ID: 4, Val: 6291456}, {ID: 6, Val: 262144}},
	WindowUpdate:   15663105,
	PseudoOrder:    []string{":method", ":authority", ":scheme", ":path"},
	HeaderPriority: &fingerprint.Priority{Exclusive: true, Weight: 255},
	FirstStreamID:  1,
}

const chromeAkamai = "1:65536;2:0;4:6291456;6:262144|15663105|0|m,a,s,p"

// getRoot sends GET / to o on cc and reads the answer whole.
func getRoot(t *testing.T, cc ClientConn, o *fporigin.Origin) {
	t.Helper()
	resp, err := cc.RoundTrip(newRequest(t, ctxTimeout(t, 10*time.Second), "GET", o.URL()+"/", nil))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
}
