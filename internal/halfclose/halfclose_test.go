package halfclose

import (
	"io"
	"net"
	"testing"
)

type wrapped struct{ net.Conn }

func TestCloseWriteReachesTCP(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	got := make(chan string, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		b, _ := io.ReadAll(c) // ends at the client's half-close
		c.Write([]byte("after EOF"))
		c.Close()
		got <- string(b)
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("hello"))
	if err := CloseWrite(c); err != nil {
		t.Fatal(err)
	}
	if s := <-got; s != "hello" {
		t.Fatalf("server read %q", s)
	}
	tail, _ := io.ReadAll(c) // the read side still works
	if string(tail) != "after EOF" {
		t.Fatalf("tail %q", tail)
	}
	// A wrapper that cannot half-close is closed instead.
	a, b := net.Pipe()
	defer b.Close()
	if err := CloseWrite(wrapped{a}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Write([]byte("x")); err == nil {
		t.Fatal("pipe still open after CloseWrite fallback")
	}
	if err := CloseRead(wrapped{b}); err != nil {
		t.Fatal(err)
	}
}

type wrapper struct{ Conn }

// TestSupportedLooksThroughWrappers: a chain of wrappers over TCP
// half-closes; over a pipe (no CloseWrite) it does not, and Supported says
// so before CloseWrite would close it.
func TestSupportedLooksThroughWrappers(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		if c, err := ln.Accept(); err == nil {
			defer c.Close()
			io.Copy(io.Discard, c)
		}
	}()
	tcp, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer tcp.Close()
	if c := (&wrapper{Conn{Conn{tcp}}}); !Supported(c) {
		t.Error("wrappers over TCP: Supported = false")
	}
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if c := (&wrapper{Conn{a}}); Supported(c) {
		t.Error("wrapper over a pipe: Supported = true, but CloseWrite would close it")
	}
	if Supported(wrapped{tcp}) {
		// wrapped hides CloseWrite and does not unwrap: nothing to see.
		t.Error("a wrapper that neither forwards nor unwraps: Supported = true")
	}
}
