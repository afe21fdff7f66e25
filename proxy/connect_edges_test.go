package proxy_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestConnectTargetIsAuthorityFormOnly: a CONNECT's target is host:port
// and nothing else (RFC 9112 §3.2.3). net/http also parses a user, a path,
// a query or a fragment out of it, and goproxy passes only the host on:
// such a CONNECT must be refused with a 400 naming the target, never
// opened to the host:port inside it with the rest dropped unseen. The
// well-formed spellings, an IPv6 literal in brackets included, still work.
func TestConnectTargetIsAuthorityFormOnly(t *testing.T) {
	var hits atomic.Int64
	origin := plainOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		echoProto(w, r)
	}))
	w := newWorld(t, worldOpts{})
	hostport := strings.TrimPrefix(origin.URL, "http://")
	_, port, _ := net.SplitHostPort(hostport)
	try := func(target string) (*http.Response, *bufio.Reader, net.Conn) {
		t.Helper()
		conn, err := net.Dial("tcp", w.proxyURL.Host)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", target, hostport)
		br := bufio.NewReader(conn)
		resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
		if err != nil {
			t.Fatalf("CONNECT %s: no answer: %v", target, err)
		}
		return resp, br, conn
	}
	for _, target := range []string{
		"user@" + hostport,
		"user:pw@" + hostport,
		hostport + "/junk",
		hostport + "?q",
		hostport + "?",
		"/path",
	} {
		t.Run(target, func(t *testing.T) {
			resp, _, _ := try(target)
			if resp.StatusCode == http.StatusOK {
				t.Fatalf("CONNECT %s: tunnel opened, want 400 bad_request", target)
			}
			body, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != http.StatusBadRequest || resp.Header.Get("X-Onceproxy-Error") != "bad_request" {
				t.Fatalf("CONNECT %s: %d %q, want 400 bad_request", target, resp.StatusCode, body)
			}
			if !resp.Close {
				t.Error("the refusal does not close the connection")
			}
		})
	}
	if n := hits.Load(); n != 0 {
		t.Fatalf("the origin was reached %d times through malformed CONNECTs", n)
	}
	// The control: host:port, and an IPv4-mapped IPv6 literal of the same
	// origin, are tunnels.
	for _, target := range []string{hostport, "[::ffff:127.0.0.1]:" + port} {
		resp, br, conn := try(target)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("CONNECT %s: %d, want 200", target, resp.StatusCode)
		}
		fmt.Fprintf(conn, "GET /ok HTTP/1.1\r\nHost: %s\r\n\r\n", hostport)
		r, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("CONNECT %s: request inside: %v", target, err)
		}
		b, _ := io.ReadAll(r.Body)
		if r.StatusCode != 200 || !strings.Contains(string(b), "path=/ok") {
			t.Fatalf("CONNECT %s: request inside got %d %q", target, r.StatusCode, b)
		}
	}
}
