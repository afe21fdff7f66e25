package socks_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
)

// pipeline is a Pipeline at the seam: it records what the door asks for,
// refuses the targets in refuse, and answers an intercepted stream itself
// (reading up to the end of an HTTP header block, answering "ok").
type pipeline struct {
	refuse map[string]bool

	mu          sync.Mutex
	checked     []socks.Tunnel
	dialled     []socks.Tunnel
	intercepted []socks.Tunnel
	held        []net.Conn // intercepted streams, kept open when hold is set
	hold        bool
}

type forbidden struct{}

func (forbidden) Error() string   { return "refusing to connect to 127.0.0.1 (loopback)" }
func (forbidden) HTTPStatus() int { return http.StatusForbidden }

func (p *pipeline) CheckTunnel(ctx context.Context, t socks.Tunnel) (context.Context, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.checked = append(p.checked, t)
	if p.refuse[t.Target] {
		return ctx, forbidden{}
	}
	return ctx, nil
}

func (p *pipeline) DialTunnel(ctx context.Context, t socks.Tunnel) (net.Conn, error) {
	p.mu.Lock()
	p.dialled = append(p.dialled, t)
	p.mu.Unlock()
	var d net.Dialer
	return d.DialContext(ctx, "tcp", t.Target)
}

func (p *pipeline) InterceptTunnel(c net.Conn, t socks.Tunnel) {
	p.mu.Lock()
	p.intercepted = append(p.intercepted, t)
	if p.hold {
		p.held = append(p.held, c)
		p.mu.Unlock()
		return
	}
	p.mu.Unlock()
	go func() {
		defer c.Close()
		br := bufio.NewReader(c)
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				return
			}
			if line == "\r\n" {
				io.WriteString(c, "ok")
				return
			}
		}
	}()
}

func (p *pipeline) record() (checked, dialled, intercepted []socks.Tunnel) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]socks.Tunnel(nil), p.checked...), append([]socks.Tunnel(nil), p.dialled...),
		append([]socks.Tunnel(nil), p.intercepted...)
}

func serve(t *testing.T, p *pipeline, cfg socks.Config) (*socks.Server, string) {
	t.Helper()
	srv, err := socks.New(cfg, socks.Options{
		Logger:           slog.New(slog.NewTextHandler(io.Discard, nil)),
		Pipeline:         p,
		MaxConns:         16,
		IdleTimeout:      time.Minute,
		HandshakeTimeout: 5 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Close()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return srv, ln.Addr().String()
}

// connect sends a no-auth greeting and a CONNECT to a host name, followed
// by early bytes in the same write, and returns the reply code.
func connect(t *testing.T, addr, host string, port int, early string) (net.Conn, byte) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	msg := []byte{5, 1, 0, 5, 1, 0, 3, byte(len(host))}
	msg = append(append(msg, host...), byte(port>>8), byte(port))
	if _, err := c.Write(append(msg, early...)); err != nil {
		t.Fatal(err)
	}
	reply := make([]byte, 2+10)
	if _, err := io.ReadFull(c, reply); err != nil {
		t.Fatalf("reply: %v", err)
	}
	if !bytes.Equal(reply[:2], []byte{5, 0}) {
		t.Fatalf("method reply % x", reply[:2])
	}
	return c, reply[3]
}

// TestInterceptGetsTheWholeStream: a client that sends its first request
// in the same write as its SOCKS5 request (no wait for the reply) has every
// byte reach the pipeline's interception, with the tunnel's facts; nothing
// is dialled on a MITM port.
func TestInterceptGetsTheWholeStream(t *testing.T) {
	p := &pipeline{}
	_, addr := serve(t, p, socks.Config{AllowNoAuth: true, MITMPorts: []int{80}})
	c, code := connect(t, addr, "origin.test", 80, "GET / HTTP/1.1\r\nHost: origin.test\r\n\r\n")
	if code != 0 {
		t.Fatalf("reply %d, want 0", code)
	}
	if b, err := io.ReadAll(c); err != nil || string(b) != "ok" {
		t.Fatalf("stream answered %q, %v: the pipeline did not get the request whole", b, err)
	}
	checked, dialled, intercepted := p.record()
	want := socks.Tunnel{Target: "origin.test:80", Client: c.LocalAddr().String()}
	if len(checked) != 1 || checked[0] != want || len(intercepted) != 1 || intercepted[0] != want {
		t.Errorf("checked %+v, intercepted %+v, want %+v each", checked, intercepted, want)
	}
	if len(dialled) != 0 {
		t.Errorf("dialled %+v on a MITM port", dialled)
	}
}

// TestRefusedTargetIsNeverDialled: a target the pipeline's check refuses
// gets 0x02 on a MITM port and on another, and reaches neither the dial
// nor the interception.
func TestRefusedTargetIsNeverDialled(t *testing.T) {
	p := &pipeline{refuse: map[string]bool{"blocked.test:80": true, "blocked.test:9999": true}}
	_, addr := serve(t, p, socks.Config{AllowNoAuth: true, MITMPorts: []int{80}})
	for _, port := range []int{80, 9999} {
		c, code := connect(t, addr, "blocked.test", port, "GET / HTTP/1.1\r\n\r\n")
		if code != 2 {
			t.Fatalf("port %d: reply %d, want 2", port, code)
		}
		if _, err := io.ReadAll(c); err != nil {
			t.Fatalf("port %d: not closed after the refusal: %v", port, err)
		}
	}
	checked, dialled, intercepted := p.record()
	if len(checked) != 2 || len(dialled) != 0 || len(intercepted) != 0 {
		t.Errorf("checked %d, dialled %+v, intercepted %+v", len(checked), dialled, intercepted)
	}
}

// TestShutdownWaitsForHandedOverStreams: a stream handed to the pipeline
// still counts as the door's connection: Shutdown waits for it until its
// context ends, then cuts it, and Serve returns nil.
func TestShutdownWaitsForHandedOverStreams(t *testing.T) {
	p := &pipeline{hold: true}
	srv, addr := serve(t, p, socks.Config{AllowNoAuth: true, MITMPorts: []int{80}})
	c, code := connect(t, addr, "origin.test", 80, "GET / HTTP/1.1\r\n\r\n")
	if code != 0 {
		t.Fatalf("reply %d", code)
	}
	deadline := time.Now().Add(5 * time.Second)
	for _, _, in := p.record(); len(in) == 0; _, _, in = p.record() {
		if time.Now().After(deadline) {
			t.Fatal("never handed over")
		}
		time.Sleep(10 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := srv.Shutdown(ctx)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown = %v, want the context's error (a stream was still open)", err)
	}
	if took := time.Since(start); took < 250*time.Millisecond {
		t.Errorf("Shutdown returned after %v, before its context ended", took)
	}
	if _, err := c.Read(make([]byte, 1)); err == nil || strings.Contains(err.Error(), "timeout") {
		t.Fatalf("the held stream survived Shutdown: %v", err)
	}
	if _, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		t.Error("the port still accepts after Shutdown")
	}
}
