package proxy_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/mitm"
	"github.com/seed-a3c387e8/onceproxy/proxy"
)

// nowhere is an upstream that never dials: the fuzzer must not send
// traffic anywhere, whatever the input asks for.
type nowhere struct{}

func (nowhere) RoundTrip(*http.Request) (*http.Response, error) {
	return nil, errors.New("fuzz: no upstream")
}

func (nowhere) DialContext(context.Context, string, string) (net.Conn, error) {
	return nil, errors.New("fuzz: no upstream")
}

// FuzzProxyConn feeds arbitrary bytes to the proxy port: request lines,
// headers, CONNECT targets, bytes after a CONNECT (TLS or HTTP inside the
// tunnel). The proxy must never panic or hang, whatever arrives.
func FuzzProxyConn(f *testing.F) {
	for _, seed := range []string{
		"GET http://example.test/ HTTP/1.1\r\nHost: example.test\r\n\r\n",
		"CONNECT example.test:443 HTTP/1.1\r\nHost: example.test:443\r\n\r\n\x16\x03\x01\x00\x05hello",
		"CONNECT example.test:80 HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\nHost: example.test\r\n\r\n",
		"CONNECT [::1]:0 HTTP/1.1\r\n\r\n",
		"CONNECT :443 HTTP/1.1\r\n\r\n",
		"POST http://example.test/ HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
		"GET /relative HTTP/1.1\r\nHost: x\r\n\r\n",
		"GET http://x/ HTTP/1.1\r\nProxy-Authorization: Basic !!!\r\n\r\n",
		"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
		"\x05\x01\x00",
	} {
		f.Add([]byte(seed))
	}
	ca, err := mitm.LoadOrCreate(mitm.Config{CADir: f.TempDir()}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		f.Fatal(err)
	}
	defer ca.Close()
	srv, err := proxy.New(proxy.Config{Listen: "127.0.0.1:0", IdleTimeout: time.Second, ReadHeaderTimeout: time.Second},
		proxy.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Certs: ca, Upstream: nowhere{}})
	if err != nil {
		f.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		f.Fatal(err)
	}
	addr := ln.Addr().String()
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
		<-served
	}()

	f.Fuzz(func(t *testing.T, in []byte) {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("proxy stopped accepting: %v", err)
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(3 * time.Second))
		conn.Write(in)
		// End of input: the proxy answers what it can and hangs up.
		conn.(*net.TCPConn).CloseWrite()
		// A panic anywhere in the proxy fails the fuzzer; a hang shows as
		// the deadline.
		if _, err := io.Copy(io.Discard, conn); err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatalf("proxy did not finish with %q within 3s", in)
			}
		}
	})
}
