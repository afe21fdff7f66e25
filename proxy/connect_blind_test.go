package proxy_test

import (
	"bufio"
	"io"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy"
)

// TestConnectToNonHTTPIsBlind: DESIGN.md's request path says "bypass host
// or not HTTP → blind tunnel", and the SOCKS5 door does just that (it
// sniffs). An HTTP CONNECT tunnel whose client speaks first in another
// protocol (SSH's "SSH-2.0-..." line, as with ssh -o ProxyCommand through
// an HTTP proxy) goes to its target byte for byte. It was read as an HTTP
// head that never ended and closed at the header timeout. (A silent client
// still is: on the HTTP door, a server that speaks first is not waited
// for.)
func TestConnectToNonHTTPIsBlind(t *testing.T) {
	w := newWorld(t, worldOpts{proxy: proxy.Config{ReadHeaderTimeout: 500 * time.Millisecond}})
	t.Run("client speaks first, not HTTP", func(t *testing.T) {
		echo := echoServer(t, "", "")
		conn, br := connectTunnel(t, w, echo)
		defer conn.Close()
		_ = conn.SetReadDeadline(time.Now().Add(3 * time.Second))
		io.WriteString(conn, "SSH-2.0-OpenSSH_9.6\r\n")
		line, err := bufio.NewReader(br).ReadString('\n')
		if err != nil || line != "SSH-2.0-OpenSSH_9.6\r\n" {
			t.Fatalf("the client's bytes never reached the server: %q, %v", line, err)
		}
	})
}
