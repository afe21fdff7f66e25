package proxy_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/mitm"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
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

// panicWatch is a slog.Handler that keeps every record reporting a
// recovered panic. Nothing else fails the fuzzer on a panic: the request
// handler and the dedup engine recover and log theirs ("panic while
// serving a request; recovered"), and net/http recovers the rest and logs
// them through the servers' ErrorLog ("http: panic serving ...").
type panicWatch struct {
	mu   sync.Mutex
	seen []string
}

func (w *panicWatch) Enabled(context.Context, slog.Level) bool { return true }

func (w *panicWatch) Handle(_ context.Context, r slog.Record) error {
	if r.Level < slog.LevelWarn || !strings.Contains(strings.ToLower(r.Message), "panic") {
		return nil
	}
	var b strings.Builder
	b.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool {
		fmt.Fprintf(&b, "\n  %s: %v", a.Key, a.Value)
		return true
	})
	w.mu.Lock()
	w.seen = append(w.seen, b.String())
	w.mu.Unlock()
	return nil
}

func (w *panicWatch) WithAttrs([]slog.Attr) slog.Handler { return w }
func (w *panicWatch) WithGroup(string) slog.Handler      { return w }

// take returns the panics seen since the last call.
func (w *panicWatch) take() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	seen := w.seen
	w.seen = nil
	return seen
}

// FuzzProxyConn feeds arbitrary bytes to the proxy port: request lines,
// headers, CONNECT targets, bytes after a CONNECT (TLS or HTTP inside the
// tunnel), through the dedup engine as in production. The proxy must never
// panic, even a panic it recovers from, nor hang, whatever arrives.
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
	watch := &panicWatch{}
	logger := slog.New(watch)
	ca, err := mitm.LoadOrCreate(mitm.Config{CADir: f.TempDir()}, logger)
	if err != nil {
		f.Fatal(err)
	}
	defer ca.Close()
	dcfg := dedup.Config{Enabled: true, TTL: time.Minute}.WithDefaults()
	store := dedup.NewMemoryStore(int64(dcfg.Memory.MaxBytes))
	defer store.Close()
	engine, err := dedup.New(dcfg, dedup.Options{Store: store, Next: nowhere{}, Logger: logger})
	if err != nil {
		f.Fatal(err)
	}
	defer engine.Close()
	srv, err := proxy.New(proxy.Config{Listen: "127.0.0.1:0", IdleTimeout: time.Second, ReadHeaderTimeout: time.Second},
		proxy.Options{Logger: logger, Certs: ca, Upstream: nowhere{}, Next: engine})
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
		// A hang shows as the deadline.
		if _, err := io.Copy(io.Discard, conn); err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatalf("proxy did not finish with %q within 3s", in)
			}
		}
		// A panic anywhere in the proxy fails the input that caused it
		// (the handler logs its panic before it stops counting itself in
		// flight; net/http logs one before it closes the connection). One
		// logged later still fails the next input.
		testkit.Poll(3*time.Second, func() bool { return srv.Inflight() == 0 })
		if p := watch.take(); len(p) > 0 {
			t.Fatalf("input %q: the proxy recovered from a panic:\n%s", in, strings.Join(p, "\n"))
		}
	})
}
