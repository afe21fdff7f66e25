package proxy_test

import (
	"bufio"
	"io"
	"net"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy"
)

// pushOrigin is a loopback service that reads its client's first line,
// then sends it n bytes in 32 KiB writes, one every pace (n < 0: until a
// write fails), while discarding whatever else the client sends. Each
// connection reports on the returned channel when its writes ended: the
// error, or nil when all n bytes went out.
func pushOrigin(t *testing.T, n int, pace time.Duration) (addr string, ended <-chan error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	ch := make(chan error, 4)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(30 * time.Second))
				br := bufio.NewReader(c)
				if _, err := br.ReadString('\n'); err != nil {
					ch <- err
					return
				}
				go io.Copy(io.Discard, br)
				chunk := make([]byte, 32<<10)
				for sent := 0; n < 0 || sent < n; {
					m := len(chunk)
					if n >= 0 {
						m = min(m, n-sent)
					}
					if _, err := c.Write(chunk[:m]); err != nil {
						ch <- err
						return
					}
					sent += m
					time.Sleep(pace)
				}
				ch <- nil
			}()
		}
	}()
	return ln.Addr().String(), ch
}

// TestBlindTunnelToAClientThatNeverReads: a blind tunnel (the client
// speaks neither TLS nor HTTP) whose client keeps sending a byte every
// 125 ms but never reads what comes back stalls the proxy's writes to it;
// the tunnel is idle in that direction and must be closed after
// proxy.idle_timeout, the upstream side with it. It was held for ever:
// each byte read from the client moved the write deadline too.
func TestBlindTunnelToAClientThatNeverReads(t *testing.T) {
	w := newWorld(t, worldOpts{proxy: proxy.Config{IdleTimeout: 500 * time.Millisecond, ReadHeaderTimeout: 2 * time.Second}})
	origin, ended := pushOrigin(t, -1, 0)
	conn, _ := connectTunnel(t, w, origin)
	defer conn.Close()
	io.WriteString(conn, "SSH-2.0-OpenSSH_9.6\r\n")
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(125 * time.Millisecond):
			}
			if _, err := conn.Write([]byte{0}); err != nil {
				return
			}
		}
	}()
	select {
	case err := <-ended:
		if err == nil {
			t.Fatal("the origin's endless stream ended without an error")
		}
	case <-time.After(8 * time.Second):
		t.Fatal("the tunnel to a client that sends but never reads was still open after 8s (idle_timeout 500ms): the origin's writes never failed")
	}
}

// TestBlindTunnelToASlowReaderIsNotCut: the other side of the same rule.
// A client that reads a download slowly, which lasts well past the idle
// timeout, and sends nothing after its first line is not idle: it must
// get every byte. (A TLS download is such a stream: the client sends
// nothing after its handshake.)
func TestBlindTunnelToASlowReaderIsNotCut(t *testing.T) {
	w := newWorld(t, worldOpts{proxy: proxy.Config{IdleTimeout: 500 * time.Millisecond, ReadHeaderTimeout: 2 * time.Second}})
	const size = 1 << 20 // 32 writes 50 ms apart: 1.6 s
	origin, ended := pushOrigin(t, size, 50*time.Millisecond)
	conn, br := connectTunnel(t, w, origin)
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	io.WriteString(conn, "SSH-2.0-OpenSSH_9.6\r\n")
	start := time.Now()
	buf := make([]byte, 16<<10)
	got := 0
	for got < size {
		n, err := br.Read(buf)
		got += n
		if err != nil {
			t.Fatalf("the slow reader was cut after %d of %d bytes (%v in): %v", got, size, time.Since(start), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := <-ended; err != nil {
		t.Fatalf("origin: %v", err)
	}
}
