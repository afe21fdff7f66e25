package proxy_test

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/socks"
)

// dialRawFrom is dialRaw from a chosen loopback source address (another
// "client" as far as the proxy's per-client accounting goes).
func dialRawFrom(t testing.TB, w *world, src string) *rawSOCKS {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	c, err := d.Dial("tcp", w.socksAddr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return &rawSOCKS{t, c}
}

// TestSocksFailedLoginsCountPerClientAddress: auth.max_failures_per_minute
// counts the failures of a client (its address), on the SOCKS5 port as on
// the HTTP port: a guesser at 127.0.0.2 does not lock out an honest client
// at 127.0.0.1 whose credentials have not been checked yet.
func TestSocksFailedLoginsCountPerClientAddress(t *testing.T) {
	w := newWorld(t, worldOpts{
		users:        map[string]string{"alice": "right", "bob": "right2"},
		authFailures: 2,
		socks5:       socksOn(socks.Config{}),
	})
	for _, pw := range []string{"guess1", "guess2", "guess3"} {
		r := dialRawFrom(t, w, "127.0.0.2")
		if got := r.greet(2); !bytes.Equal(got, []byte{5, 2}) {
			t.Fatalf("guesser method reply % x", got)
		}
		if got := r.login("alice", pw); !bytes.Equal(got, []byte{1, 1}) {
			t.Fatalf("guess %q: % x, want 01 01", pw, got)
		}
		r.c.Close()
	}
	// Another address, credentials never tried before: checked, accepted.
	r := dialRawFrom(t, w, "127.0.0.1")
	if got := r.greet(2); !bytes.Equal(got, []byte{5, 2}) {
		t.Fatalf("honest client method reply % x", got)
	}
	if got := r.login("bob", "right2"); !bytes.Equal(got, []byte{1, 0}) {
		t.Fatalf("honest client at 127.0.0.1 with right credentials got % x, want 01 00: "+
			"the guesser at 127.0.0.2 locked out every SOCKS5 client", got)
	}
}

// TestSocksPerClientCapAnswersInSOCKS5: a client past
// proxy.max_conns_per_client on the SOCKS5 port gets a SOCKS5 refusal (the
// method reply 05 FF), not an HTTP/1.1 429 that no SOCKS5 client can parse.
func TestSocksPerClientCapAnswersInSOCKS5(t *testing.T) {
	w := newWorld(t, worldOpts{
		proxy:  proxy.Config{MaxConnsPerClient: 1},
		socks5: socksOn(socks.Config{AllowNoAuth: true}),
	})
	a := dialRaw(t, w)
	if got := a.greet(0); !bytes.Equal(got, []byte{5, 0}) {
		t.Fatalf("first: % x", got)
	}
	// At once (well within the second after which an idle first
	// connection would give way).
	b := dialRaw(t, w)
	_, _ = b.c.Write([]byte{5, 1, 0})
	got, _ := io.ReadAll(b.c)
	if !bytes.Equal(got, []byte{5, 0xff}) {
		t.Fatalf("second connection from the same client: got %q, want the SOCKS5 refusal 05 ff", got)
	}
}

// TestSocksAuthFailuresAreCounted: onceproxy_auth_failures_total counts the
// clients the SOCKS5 door refused for their credentials, as it counts the
// HTTP port's 407s: a wrong login, and a client that offers no
// user/password at all where a user store is configured.
func TestSocksAuthFailuresAreCounted(t *testing.T) {
	w := newWorld(t, worldOpts{
		users:  map[string]string{"alice": "right"},
		socks5: socksOn(socks.Config{}),
	})
	r := dialRaw(t, w)
	if got := r.greet(2); !bytes.Equal(got, []byte{5, 2}) {
		t.Fatalf("method reply % x", got)
	}
	if got := r.login("alice", "wrong"); !bytes.Equal(got, []byte{1, 1}) {
		t.Fatalf("wrong login: % x, want 01 01", got)
	}
	r.c.Close()
	n := dialRaw(t, w)
	if got := n.greet(0); !bytes.Equal(got, []byte{5, 0xff}) {
		t.Fatalf("no-auth offer: % x, want 05 ff", got)
	}
	n.c.Close()
	ok := dialRaw(t, w)
	ok.greet(2)
	if got := ok.login("alice", "right"); !bytes.Equal(got, []byte{1, 0}) {
		t.Fatalf("right login: % x, want 01 00", got)
	}
	// The door counts after it answered: wait for the count to land.
	deadline := time.Now().Add(5 * time.Second)
	for w.metricLine("onceproxy_auth_failures_total") != "onceproxy_auth_failures_total 2" {
		if time.Now().After(deadline) {
			t.Fatalf("%q, want 2 failures counted", w.metricLine("onceproxy_auth_failures_total"))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestSOCKS5MalformedExchangesGetReplies: a sub-negotiation that is not
// RFC 1929's gets its failure status (01 01) before the close, as a wrong
// password does, and a request of another version gets SOCKS5's general
// failure (05 01). Both used to be closed without a word.
func TestSOCKS5MalformedExchangesGetReplies(t *testing.T) {
	w := newWorld(t, worldOpts{
		users:  map[string]string{"alice": "right"},
		socks5: socksOn(socks.Config{}),
	})
	t.Run("auth of version 5", func(t *testing.T) {
		r := dialRaw(t, w)
		r.greet(2)
		r.send([]byte{5, 5, 'a', 'l', 'i', 'c', 'e', 5, 'r', 'i', 'g', 'h', 't'})
		if got := r.read(2); !bytes.Equal(got, []byte{1, 1}) {
			t.Errorf("malformed auth: % x, want 01 01", got)
		}
		r.expectClosed()
	})
	t.Run("request of version 4", func(t *testing.T) {
		r := dialRaw(t, w)
		r.greet(2)
		if got := r.login("alice", "right"); !bytes.Equal(got, []byte{1, 0}) {
			t.Fatalf("login: % x", got)
		}
		r.send([]byte{4, 1, 0, 1, 127, 0, 0, 1, 0, 80})
		if got := r.read(2); !bytes.Equal(got, []byte{5, 1}) {
			t.Errorf("malformed request: % x, want 05 01", got)
		}
		r.expectClosed()
	})
}
