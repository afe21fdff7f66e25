package connlimit

import (
	"errors"
	"net"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/halfclose"
)

func accept(t *testing.T, l *Listener) <-chan net.Conn {
	t.Helper()
	ch := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			close(ch)
			return
		}
		ch <- c
	}()
	return ch
}

// TestCapSlotsAndCloseAll: beyond MaxConns, Accept waits for a slot; a
// closed connection frees its slot; CloseAll cuts the live ones; Close
// ends an Accept waiting for a slot.
func TestCapSlotsAndCloseAll(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := New(ln, Config{MaxConns: 1, IdleTimeout: time.Minute})
	defer l.Close()
	var clients []net.Conn
	dial := func() {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		clients = append(clients, c)
	}
	defer func() {
		for _, c := range clients {
			c.Close()
		}
	}()

	dial()
	first := <-accept(t, l)
	if !halfclose.Supported(first) {
		t.Error("half-close hidden by the listener's wrappers")
	}
	dial()
	second := accept(t, l)
	select {
	case <-second:
		t.Fatal("a second connection was accepted beyond MaxConns")
	case <-time.After(100 * time.Millisecond):
	}
	if n := l.Len(); n != 1 {
		t.Fatalf("Len = %d, want 1", n)
	}
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	var c2 net.Conn
	select {
	case c2 = <-second:
	case <-time.After(5 * time.Second):
		t.Fatal("the freed slot was not given to the waiting client")
	}
	l.CloseAll()
	if _, err := c2.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("read after CloseAll: %v, want net.ErrClosed", err)
	}
	if n := l.Len(); n != 0 {
		t.Fatalf("Len after CloseAll = %d", n)
	}

}

// TestCloseEndsAcceptWaitingForSlot: a full listener's Accept waits for a
// slot; Close ends that wait.
func TestCloseEndsAcceptWaitingForSlot(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := New(ln, Config{MaxConns: 1})
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	held := <-accept(t, l)
	defer held.Close()
	waiting := accept(t, l)
	time.Sleep(50 * time.Millisecond) // let it block on the slot
	l.Close()
	select {
	case c, ok := <-waiting:
		if ok {
			t.Fatalf("Accept after Close returned %v", c.RemoteAddr())
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not end an Accept waiting for a slot")
	}
}
