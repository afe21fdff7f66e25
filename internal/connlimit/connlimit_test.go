package connlimit

import (
	"errors"
	"io"
	"net"
	"os"
	"strings"
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

// listen runs a Listener with cfg on a loopback port until t ends.
func listen(t *testing.T, cfg Config) (net.Listener, *Listener) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := New(ln, cfg)
	t.Cleanup(func() { l.Close() })
	return ln, l
}

// acceptOne is the next connection l accepts, the one just dialled from
// src; a refusal (Accept goes on waiting) fails t instead of hanging it.
func acceptOne(t *testing.T, l *Listener, src string) net.Conn {
	t.Helper()
	select {
	case c := <-accept(t, l):
		return c
	case <-time.After(5 * time.Second):
		t.Fatalf("a connection from %s was not accepted", src)
		return nil
	}
}

// TestCapSlotsAndCloseAll: beyond MaxConns, Accept waits for a slot; a
// closed connection frees its slot; CloseAll cuts the live ones; Close
// ends an Accept waiting for a slot.
func TestCapSlotsAndCloseAll(t *testing.T) {
	ln, l := listen(t, Config{MaxConns: 1, IdleTimeout: time.Minute})
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

// dialFrom connects to ln from a given loopback source address.
func dialFrom(t *testing.T, ln net.Listener, src string) net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	c, err := d.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestPerClientCap: one address may hold MaxPerClient connections; the
// next is told why (429) and closed, another address is not affected, and
// Attribute moves a connection to its account's count.
func TestPerClientCap(t *testing.T) {
	ln, l := listen(t, Config{MaxConns: 100, MaxPerClient: 2})
	accepted := make(chan net.Conn, 10)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	a1, a2 := dialFrom(t, ln, "127.0.0.1"), dialFrom(t, ln, "127.0.0.1")
	s1, s2 := <-accepted, <-accepted
	over := dialFrom(t, ln, "127.0.0.1")
	_ = over.SetReadDeadline(time.Now().Add(5 * time.Second))
	b, _ := io.ReadAll(over)
	if !strings.Contains(string(b), "429 Too Many Requests") || !strings.Contains(string(b), "max_conns_per_client = 2") {
		t.Fatalf("the third connection from one address got %q", b)
	}
	other := dialFrom(t, ln, "127.0.0.2")
	s3 := <-accepted
	if got := l.Stats(); got.Live != 3 || got.Refused != 1 {
		t.Fatalf("stats %+v, want 3 live, 1 refused", got)
	}
	// An account gets its own count: moving one connection frees a slot
	// of its address.
	if err := Attribute(s1, "user:alice"); err != nil {
		t.Fatal(err)
	}
	dialFrom(t, ln, "127.0.0.1")
	s4 := <-accepted
	if err := Attribute(s2, "user:alice"); err != nil {
		t.Fatal(err)
	}
	if err := Attribute(s4, "user:alice"); !errors.Is(err, ErrTooManyConns) {
		t.Fatalf("a third connection of one account: %v, want ErrTooManyConns", err)
	}
	// Closing gives the account's share back.
	s1.Close()
	if err := Attribute(s4, "user:alice"); err != nil {
		t.Fatalf("after one of alice's connections closed: %v", err)
	}
	_, _, _ = a1, a2, other
	_ = s3
}

// TestShedsIdleFirst: above the high-water mark the connection idle the
// longest is shed to make room; one that moved bytes within the last
// second, or that its server marked busy, never is.
func TestShedsIdleFirst(t *testing.T) {
	ln, l := listen(t, Config{MaxConns: 4}) // high water: 3
	accept1 := func(src string) (client, server net.Conn) {
		return dialFrom(t, ln, src), acceptOne(t, l, src)
	}
	_, silent := accept1("127.0.0.1")
	cBusy, busy := accept1("127.0.0.2")
	SetBusy(busy, true)
	time.Sleep(1100 * time.Millisecond) // past shedIdle for the first three
	cActive, active := accept1("127.0.0.3")
	go io.Copy(io.Discard, cActive)
	active.Write([]byte("x")) // moved a byte just now
	// A fourth connection crosses the high-water mark: the silent one goes.
	_, _ = accept1("127.0.0.4")
	if _, err := silent.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("the silent connection was not shed: %v", err)
	}
	for name, c := range map[string]net.Conn{"busy": busy, "active": active} {
		_ = c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		var ne net.Error
		if _, err := c.Read(make([]byte, 1)); !errors.As(err, &ne) || !ne.Timeout() {
			t.Errorf("the %s connection was shed: %v", name, err)
		}
		_ = c.SetReadDeadline(time.Time{})
	}
	if st := l.Stats(); st.Shed != 1 || st.Live != 3 {
		t.Fatalf("stats %+v, want 1 shed, 3 live", st)
	}
	_ = cBusy
}

// TestClientAtItsCapGivesUpAnIdleConnection: a client that opens a
// connection per request and leaves each idle is not refused at its cap
// while one of its connections has been idle past shedIdle: the idlest
// goes, by address and by account. Busy or recently active ones are never
// given up, and the refusal still comes when nothing is idle.
func TestClientAtItsCapGivesUpAnIdleConnection(t *testing.T) {
	ln, l := listen(t, Config{MaxConns: 100, MaxPerClient: 2})
	accept1 := func(src string) net.Conn {
		dialFrom(t, ln, src)
		return acceptOne(t, l, src)
	}
	old := accept1("127.0.0.1")
	busy := accept1("127.0.0.1")
	SetBusy(busy, true)
	time.Sleep(1100 * time.Millisecond) // past shedIdle

	third := accept1("127.0.0.1") // the idle one gives way
	if _, err := old.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("the idle connection was not given up: %v", err)
	}
	// Now busy (busy) and third (new, not idle): the next one is refused
	// (inside an Accept, which goes on to the connection after it).
	pending := accept(t, l)
	over := dialFrom(t, ln, "127.0.0.1")
	_ = over.SetReadDeadline(time.Now().Add(5 * time.Second))
	if b, _ := io.ReadAll(over); !strings.Contains(string(b), "429 Too Many Requests") {
		t.Fatalf("with nothing idle, the third connection got %q", b)
	}

	// By account: two connections of alice, one idle; a third moved to
	// her takes the idle one's place.
	dialFrom(t, ln, "127.0.0.2")
	a1 := <-pending
	a2 := accept1("127.0.0.3")
	for _, c := range []net.Conn{a1, a2} {
		if err := Attribute(c, "user:alice"); err != nil {
			t.Fatal(err)
		}
	}
	SetBusy(a2, true)
	time.Sleep(1100 * time.Millisecond)
	if err := Attribute(third, "user:alice"); err != nil {
		t.Fatalf("alice at her cap with an idle connection: %v", err)
	}
	if _, err := a1.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("alice's idle connection was not given up: %v", err)
	}
	third.Write([]byte("x")) // alice's other one moved a byte just now
	if err := Attribute(busy, "user:alice"); !errors.Is(err, ErrTooManyConns) {
		t.Fatalf("alice at her cap with nothing idle: %v, want ErrTooManyConns", err)
	}
	if st := l.Stats(); st.Shed != 2 || st.Refused != 2 {
		t.Fatalf("stats %+v, want 2 shed, 2 refused", st)
	}
}

// TestRefuseInProtocol: with RefuseInProtocol, a connection over its
// client's cap is handed to the server marked with the cap (OverCap), sent
// nothing by the listener, counted as refused, and holds its slot until
// the server closes it; the others are unmarked.
func TestRefuseInProtocol(t *testing.T) {
	ln, l := listen(t, Config{MaxConns: 100, MaxPerClient: 1, RefuseInProtocol: true})
	dialFrom(t, ln, "127.0.0.1")
	first := acceptOne(t, l, "127.0.0.1")
	if n := OverCap(first); n != 0 {
		t.Fatalf("the first connection is marked over a cap of %d", n)
	}
	over := dialFrom(t, ln, "127.0.0.1")
	s := acceptOne(t, l, "127.0.0.1")
	if n := OverCap(halfclose.Conn{Conn: s}); n != 1 {
		t.Fatalf("OverCap of the second connection (through a wrapper) = %d, want 1", n)
	}
	if got := l.Stats(); got.Live != 2 || got.Refused != 1 {
		t.Fatalf("stats %+v, want 2 live (the refused one until its server closes it), 1 refused", got)
	}
	_ = over.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if n, err := over.Read(make([]byte, 1)); n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the listener wrote to the refused connection itself: %d bytes, %v", n, err)
	}
	s.Close()
	if got := l.Stats(); got.Live != 1 {
		t.Fatalf("after the server closed the refused connection: %+v, want 1 live", got)
	}
}
