package socks_test

import (
	"bytes"
	"io"
	"log/slog"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
)

// addrUsers accepts one password and records the client each Verify
// names.
type addrUsers struct {
	mu      sync.Mutex
	clients []string
}

func (u *addrUsers) Verify(client, user, password string) (bool, time.Duration) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.clients = append(u.clients, client)
	return password == "right", 0
}

// TestVerifyHearsTheClientAddress: over a real connection, the user store
// hears which client asks, as on the HTTP port: its failure limit is per
// client address, and a door that named no address would count every
// SOCKS5 client as one ("ip:").
func TestVerifyHearsTheClientAddress(t *testing.T) {
	users := &addrUsers{}
	srv, err := socks.New(socks.Config{}, socks.Options{
		Logger:           slog.New(slog.NewTextHandler(io.Discard, nil)),
		Pipeline:         &pipeline{},
		Users:            users,
		MaxConns:         4,
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
	defer func() { srv.Close(); <-served }()

	d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
	c, err := d.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	c.Write([]byte{5, 1, 2})
	c.Write([]byte{1, 5, 'a', 'l', 'i', 'c', 'e', 5, 'w', 'r', 'o', 'n', 'g'})
	got := make([]byte, 4)
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, []byte{5, 2, 1, 1}) {
		t.Fatalf("greeting and login replies % x, %v; want 05 02 01 01", got, err)
	}
	users.mu.Lock()
	defer users.mu.Unlock()
	if len(users.clients) != 1 || users.clients[0] != "ip:127.0.0.2" {
		t.Fatalf("the user store was asked for clients %q, want [ip:127.0.0.2]", users.clients)
	}
}
