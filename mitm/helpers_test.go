package mitm

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"
)

// fakeClock is a settable clock for certificate validity and cache expiry.
type fakeClock struct {
	mu sync.Mutex // protects t
	t  time.Time
}

func newFakeClock(t time.Time) *fakeClock { return &fakeClock{t: t} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// newTestAuthority loads or creates a CA in cfg.CADir (a fresh temp dir if empty) with the given clock (time.Now
// if nil), and closes it when the test ends.
func newTestAuthority(t testing.TB, cfg Config, now func() time.Time) *Authority {
	t.Helper()
	if cfg.CADir == "" {
		cfg.CADir = t.TempDir()
	}
	if now == nil {
		now = time.Now
	}
	a, err := loadOrCreate(cfg, nil, now)
	if err != nil {
		t.Fatalf("loadOrCreate: %v", err)
	}
	t.Cleanup(a.Close)
	return a
}

func caPool(a *Authority) *x509.CertPool {
	pool := x509.NewCertPool()
	pool.AddCert(a.Certificate())
	return pool
}

// handshake runs a TLS handshake over a loopback TCP connection and returns the client's view of it.
func handshake(t *testing.T, serverCfg, clientCfg *tls.Config) (tls.ConnectionState, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	defer ln.Close()

	serverErr := make(chan error, 1)
	go func() {
		conn, err := ln.Accept()
		if err != nil {
			serverErr <- err
			return
		}
		defer conn.Close()
		serverErr <- tls.Server(conn, serverCfg).HandshakeContext(ctx)
	}()

	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", ln.Addr().String())
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer conn.Close()
	client := tls.Client(conn, clientCfg)
	if err := client.HandshakeContext(ctx); err != nil {
		// The server's error says why; the client only sees an alert.
		_ = conn.Close()
		return tls.ConnectionState{}, fmt.Errorf("client: %w; server: %v", err, <-serverErr)
	}
	if err := <-serverErr; err != nil {
		return tls.ConnectionState{}, err
	}
	return client.ConnectionState(), nil
}
