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
