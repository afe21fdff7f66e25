package upstream

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync"
	"testing"
	"time"
)

// TestConnectAny2xxOpensTheTunnel: a gateway that answers CONNECT with a
// 2xx other than 200 has opened the tunnel (RFC 9110 §9.3.6); it was
// taken for a refusal.
func TestConnectAny2xxOpensTheTunnel(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		req, err := http.ReadRequest(bufio.NewReader(c))
		if err != nil || req.Method != http.MethodConnect {
			return
		}
		io.WriteString(c, "HTTP/1.1 204 Tunnel open\r\n\r\n")
		io.WriteString(c, "hello through the tunnel")
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := connectThrough(ctx, &net.Dialer{Timeout: 2 * time.Second}, &url.URL{Scheme: "http", Host: ln.Addr().String()}, "origin.test:443")
	if err != nil {
		t.Fatalf("a 204 to CONNECT: %v", err)
	}
	defer conn.Close()
	got, err := io.ReadAll(conn)
	if err != nil || string(got) != "hello through the tunnel" {
		t.Fatalf("tunnel read %q, %v", got, err)
	}
}
