package proxy_test

import (
	"bufio"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy"
)

// upgradeOrigin switches to a made-up protocol ("echo/1", as
// Docker's "tcp" or kubectl's "SPDY/3.1" are to the proxy) on request
// and echoes every line it then reads, prefixed.
func upgradeOrigin() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.EqualFold(r.Header.Get("Upgrade"), "echo/1") {
			http.Error(w, "upgrade required", http.StatusUpgradeRequired)
			return
		}
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo/1\r\n\r\n")
		for {
			line, err := brw.ReadString('\n')
			if err != nil {
				return
			}
			io.WriteString(c, "echo:"+line)
		}
	})
}

// TestNonWebSocketUpgradeGoesAsAPlainRequest: a client that asks for a
// protocol switch other than WebSocket (Upgrade: echo/1 here; in the wild
// kubectl's SPDY/3.1, Docker's tcp, h2c) gets the origin's answer to the
// request without its Upgrade, on a connection that goes on serving. The
// proxy carries WebSocket only: the Upgrade once went out, and the
// origin's 101 left the client waiting on a connection nothing spliced
// until idle_timeout (holding Shutdown for its whole grace too).
func TestNonWebSocketUpgradeGoesAsAPlainRequest(t *testing.T) {
	plainO := plainOrigin(t, upgradeOrigin())
	tlsO := tlsOrigin(t, upgradeOrigin(), true)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{tlsO.Certificate()}, proxy: proxy.Config{ShutdownGrace: time.Second}})

	check := func(t *testing.T, c net.Conn, target, host string) {
		_ = c.SetDeadline(time.Now().Add(3 * time.Second))
		br := bufio.NewReader(c)
		for range 2 {
			fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: echo/1\r\n\r\n", target, host)
			resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodGet})
			if err != nil {
				t.Fatalf("no answer to the upgrade: %v", err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusUpgradeRequired {
				t.Fatalf("status %d, want the origin's 426 to the request without Upgrade", resp.StatusCode)
			}
		}
	}
	t.Run("proxy port", func(t *testing.T) {
		c, err := net.Dial("tcp", w.proxyURL.Host)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		host := strings.TrimPrefix(plainO.URL, "http://")
		check(t, c, plainO.URL+"/up", host)
	})
	t.Run("intercepted tunnel", func(t *testing.T) {
		host := strings.TrimPrefix(tlsO.URL, "https://")
		c := insideTunnel(t, w, host, true)
		check(t, c, "/up", host)
	})
}
