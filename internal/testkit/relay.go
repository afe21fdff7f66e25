package testkit

import (
	"io"
	"net"
	"sync"
	"testing"
)

// Relay forwards TCP connections to a server, and can fail the network
// between in two ways: Cut closes every connection and refuses new ones (a
// partition), Mute drops what the server answers while what clients send
// still arrives (a network that loses the replies: the server carries out
// a request whose client never learns it did).
type Relay struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	cut   bool
	mute  bool
	conns []net.Conn
	muted []net.Conn // client sides that lost an answer
}

// StartRelay relays to target (host:port) until the test ends.
func StartRelay(t testing.TB, target string) *Relay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &Relay{ln: ln, target: target}
	t.Cleanup(func() { ln.Close(); r.Cut(true) })
	go r.accept()
	return r
}

// Addr is where clients connect instead of the server.
func (r *Relay) Addr() string { return r.ln.Addr().String() }

func (r *Relay) accept() {
	for {
		c, err := r.ln.Accept()
		if err != nil {
			return
		}
		r.mu.Lock()
		if r.cut {
			r.mu.Unlock()
			c.Close()
			continue
		}
		u, err := net.Dial("tcp", r.target)
		if err != nil {
			r.mu.Unlock()
			c.Close()
			continue
		}
		r.conns = append(r.conns, c, u)
		r.mu.Unlock()
		go func() { io.Copy(u, c); u.Close() }()
		go func() { r.answer(c, u); c.Close() }()
	}
}

// answer copies what the server says to the client, unless muted.
func (r *Relay) answer(c, u net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := u.Read(buf)
		if n > 0 {
			r.mu.Lock()
			mute := r.mute
			if mute {
				r.muted = append(r.muted, c)
			}
			r.mu.Unlock()
			if !mute {
				if _, err := c.Write(buf[:n]); err != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// Cut closes every connection and refuses new ones until Cut(false).
func (r *Relay) Cut(cut bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cut = cut
	if cut {
		for _, c := range r.conns {
			c.Close()
		}
		r.conns, r.muted = nil, nil
	}
}

// Mute drops the server's answers until Mute(false), which closes the
// connections that lost one: their clients would read the next answer
// as that one's.
func (r *Relay) Mute(mute bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.mute = mute
	if !mute {
		for _, c := range r.muted {
			c.Close()
		}
		r.muted = nil
	}
}
