// Package testkit holds what the tests of several packages share: waiting
// for a condition, a loopback address nobody listens on, a loopback TCP
// connection's two ends, a loopback server that answers raw bytes,
// fetching JSON from an admin endpoint. Only tests import it.
//
// Deadlines are generous on purpose: the suite runs with -race on two
// loaded cores, where a step that takes milliseconds on a laptop can take
// seconds. A deadline here only bounds how long a broken test hangs; it is
// never what a test measures.
package testkit

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Patience is the deadline to use for anything that should happen
// promptly: a flight's waiters to gather, a log line to appear, a breaker
// to open.
const Patience = time.Minute

// pollEvery is how often a condition is checked again.
const pollEvery = 5 * time.Millisecond

// Eventually checks cond until it holds, and fails the test with msg
// (formatted with args) if it still does not after timeout. It calls
// t.Fatalf, so it must run on the test's own goroutine; an origin handler
// or any other goroutine uses Poll and reports what it saw.
func Eventually(t testing.TB, timeout time.Duration, cond func() bool, msg string, args ...any) {
	t.Helper()
	if !Poll(timeout, cond) {
		t.Fatalf("timed out after %s waiting for %s", timeout, fmt.Sprintf(msg, args...))
	}
}

// Wait is Eventually for any goroutine but the test's, an origin's handler
// above all: on timeout it reports with t.Errorf (which any goroutine may
// call, unlike t.Fatalf) and returns false, so that the caller stops what
// it was doing; the test then fails when it finishes.
func Wait(t testing.TB, timeout time.Duration, cond func() bool, msg string, args ...any) bool {
	if Poll(timeout, cond) {
		return true
	}
	t.Errorf("timed out after %s waiting for %s", timeout, fmt.Sprintf(msg, args...))
	return false
}

// Poll checks cond until it holds or timeout passes, and reports whether
// it held. It is safe on any goroutine.
func Poll(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(pollEvery)
	}
	return true
}

// DeadAddr returns a loopback host:port nobody listens on: a port that was
// free a moment ago. Dialling it is refused at once.
func DeadAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// ServerPort returns a free loopback port for a server a test runs as a
// child process (redis-server, postgres), which binds it a moment later
// and again after a restart. It is drawn below the kernel's ephemeral
// range: a port from there (what listening on :0 gives) can be taken in
// between as the local end of any test's outgoing connection, and
// postgres then fails with "Address already in use".
func ServerPort(t testing.TB) int {
	t.Helper()
	lo := ephemeralLow()
	base := max(lo/2, 1024)
	for range 1000 {
		port := base + rand.IntN(lo-base)
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue // another test's server has it
		}
		ln.Close()
		return port
	}
	t.Fatalf("no free port in [%d, %d)", base, lo)
	return 0
}

// ephemeralLow is the first port of the kernel's ephemeral range (32768
// where it cannot be read).
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 32768
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 32768
	}
	n, err := strconv.Atoi(f[0])
	if err != nil || n < 4096 {
		return 32768
	}
	return n
}

// jsonClient never goes through a proxy, whatever the environment says.
var jsonClient = &http.Client{Transport: &http.Transport{Proxy: nil}, Timeout: Patience}

// GetJSON fetches u and decodes its JSON body into v. It returns an error
// rather than failing a test so that it can run on any goroutine (an
// origin handler that waits for the fleet's admin counters).
func GetJSON(u string, v any) error {
	resp, err := jsonClient.Get(u)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("GET %s: %s: %q", u, resp.Status, b)
	}
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		return fmt.Errorf("GET %s: decode: %w", u, err)
	}
	return nil
}

// TCPPair returns the two ends of a loopback TCP connection, closed when
// the test ends: for a test that needs real socket behaviour (deadlines,
// half-closes, kernel buffers) where net.Pipe has none.
func TCPPair(t testing.TB) (client, server net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept() // nil on failure
		accepted <- c
	}()
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server = <-accepted
	if server == nil {
		client.Close()
		t.Fatal("testkit: accept failed")
	}
	t.Cleanup(func() { client.Close(); server.Close() })
	return client, server
}

// RawHTTP listens on a loopback port until the test ends and answers every
// HTTP request there (a CONNECT to a gateway included) with answer, raw
// bytes, then closes the connection: an origin or a gateway that says
// exactly what a test needs. It returns the address.
func RawHTTP(t testing.TB, answer string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(10 * time.Second))
				if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
					return
				}
				io.WriteString(c, answer)
			}()
		}
	}()
	return ln.Addr().String()
}
