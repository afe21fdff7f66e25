package readahead

import (
	"bufio"
	"io"
	"net"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/halfclose"
)

// TestBufferedReplaysThenReads: what a bufio.Reader buffered comes first,
// then the connection; half-close still reaches TCP underneath.
func TestBufferedReplaysThenReads(t *testing.T) {
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
		defer c.Close()
		c.Write([]byte("HEADER\nbody-start"))
		b, _ := io.ReadAll(c) // ends at the client's half-close
		c.Write([]byte("|after EOF"))
		got <- string(b)
	}()
	raw, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	br := bufio.NewReader(raw)
	if line, err := br.ReadString('\n'); err != nil || line != "HEADER\n" {
		t.Fatalf("header %q, %v", line, err)
	}
	// Wait until the rest is buffered, as a handshake reader would have it.
	if _, err := br.Peek(len("body-start")); err != nil {
		t.Fatal(err)
	}
	c := Buffered(raw, br)
	if _, ok := c.(*Conn); !ok {
		t.Fatalf("Buffered with bytes pending returned %T", c)
	}
	if !halfclose.Supported(c) {
		t.Fatal("half-close not seen through the wrapper")
	}
	c.Write([]byte("ping"))
	if err := halfclose.CloseWrite(c); err != nil {
		t.Fatal(err)
	}
	if s := <-got; s != "ping" {
		t.Fatalf("server read %q", s)
	}
	rest, err := io.ReadAll(c)
	if err != nil || string(rest) != "body-start|after EOF" {
		t.Fatalf("read %q, %v", rest, err)
	}
}

func TestNewWithoutBytesIsTheConn(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if c := New(a, nil); c != a {
		t.Fatalf("New(c, nil) = %T, want c itself", c)
	}
	if c := Buffered(a, bufio.NewReader(a)); c != a {
		t.Fatalf("Buffered with nothing buffered = %T, want c itself", c)
	}
	// Small reads drain the pending bytes in order.
	c := New(a, []byte("abc"))
	go b.Write([]byte("d"))
	var out []byte
	for len(out) < 4 {
		p := make([]byte, 2)
		n, err := c.Read(p)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, p[:n]...)
	}
	if string(out) != "abcd" {
		t.Fatalf("read %q", out)
	}
}
