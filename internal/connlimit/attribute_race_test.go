package connlimit

import (
	"errors"
	"net"
	"sync"
	"testing"
	"time"
)

// slowClose is a connection whose Close waits until hold is closed: a
// victim being shed stays in the listener's books for that long.
type slowClose struct {
	net.Conn
	hold <-chan struct{}
}

func (c slowClose) Close() error {
	<-c.hold
	return c.Conn.Close()
}

// slowCloseListener hands out slowClose connections.
type slowCloseListener struct {
	net.Listener
	hold <-chan struct{}
}

func (l slowCloseListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return slowClose{Conn: c, hold: l.hold}, nil
}

// TestIdleVictimGivesWayOnce: one idle connection makes room for one
// connection of its client, not for every one attributed while it is
// being closed. Two connections moved to an account at its cap with one
// idle connection both used to pick that same victim, and the account
// ended up over its cap.
func TestIdleVictimGivesWayOnce(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hold := make(chan struct{})
	var release sync.Once
	unhold := func() { release.Do(func() { close(hold) }) }
	defer unhold()
	l := New(slowCloseListener{Listener: ln, hold: hold}, Config{MaxConns: 100, MaxPerClient: 1})
	defer l.Close()
	accept1 := func(src string) net.Conn {
		dialFrom(t, ln, src)
		return acceptOne(t, l, src)
	}
	idle := accept1("127.0.0.1")
	first, second := accept1("127.0.0.2"), accept1("127.0.0.3")
	if err := Attribute(idle, "user:alice"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond) // past shedIdle
	SetBusy(first, true)
	SetBusy(second, true)

	// The first takes the idle one's place; its Close is slow to finish.
	firstDone := make(chan error, 1)
	go func() { firstDone <- Attribute(first, "user:alice") }()
	for {
		l.mu.Lock()
		n := l.clients["user:alice"]
		l.mu.Unlock()
		if n == 2 { // first counted; the victim not yet gone
			break
		}
		time.Sleep(time.Millisecond)
	}
	// The second must be refused: its only idle connection already gives
	// way. Taking the same victim counts it at once, and leaves it
	// waiting on that victim's Close.
	secondDone := make(chan error, 1)
	go func() { secondDone <- Attribute(second, "user:alice") }()
	for refused := false; !refused; {
		select {
		case err := <-secondDone:
			if !errors.Is(err, ErrTooManyConns) {
				t.Fatalf("a second connection while the one idle connection already gives way: %v, want ErrTooManyConns", err)
			}
			refused = true
		default:
			l.mu.Lock()
			n := l.clients["user:alice"]
			l.mu.Unlock()
			if n > 2 {
				unhold()
				<-secondDone
				t.Fatalf("alice counts %d connections: one idle connection made room for two", n)
			}
			time.Sleep(time.Millisecond)
		}
	}
	unhold()
	if err := <-firstDone; err != nil {
		t.Fatalf("the first connection: %v", err)
	}
	l.mu.Lock()
	n := l.clients["user:alice"]
	l.mu.Unlock()
	if n != 1 {
		t.Fatalf("alice holds %d connections, want 1 (her cap)", n)
	}
}
