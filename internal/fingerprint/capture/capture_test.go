package capture

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
)

// testCert is a certificate for the TLS tests (crypto/tls's test helper
// is not exported; httptest's server certificate serves).
func testCert(t *testing.T) tls.Certificate {
	t.Helper()
	s := httptest.NewTLSServer(http.NotFoundHandler())
	defer s.Close()
	return s.TLS.Certificates[0]
}

// TestPeekClientHelloAgreesWithCryptoTLS reads a Go client's hello with
// PeekClientHello, then completes the handshake on the replaying conn and
// compares the parse with what crypto/tls itself parsed.
func TestPeekClientHelloAgreesWithCryptoTLS(t *testing.T) {
	cert := testCert(t)
	for _, tc := range []struct {
		name string
		cfg  *tls.Config
	}{
		{"tls13 with sni and alpn", &tls.Config{ServerName: "example.com", NextProtos: []string{"h2", "http/1.1"}}},
		{"tls12 only, no sni", &tls.Config{MaxVersion: tls.VersionTLS12}},
		{"one curve", &tls.Config{ServerName: "a.test", CurvePreferences: []tls.CurveID{tls.CurveP384}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cli, srv := net.Pipe()
			defer cli.Close()
			defer srv.Close()
			tc.cfg.InsecureSkipVerify = true
			go func() {
				c := tls.Client(cli, tc.cfg)
				if c.Handshake() == nil {
					c.Write([]byte("ping"))
				}
			}()
			conn, hello, err := PeekClientHello(srv)
			if err != nil {
				t.Fatal(err)
			}
			var info *tls.ClientHelloInfo
			s := tls.Server(conn, &tls.Config{
				Certificates: []tls.Certificate{cert},
				NextProtos:   []string{"h2", "http/1.1"},
				GetConfigForClient: func(i *tls.ClientHelloInfo) (*tls.Config, error) {
					info = i
					return nil, nil
				},
			})
			buf := make([]byte, 4)
			if _, err := io.ReadFull(s, buf); err != nil || string(buf) != "ping" {
				t.Fatalf("handshake over the replaying conn: %q, %v", buf, err)
			}
			var exts []uint16
			for _, x := range hello.Extensions {
				exts = append(exts, x.Type)
			}
			var curves []uint16
			for _, c := range info.SupportedCurves {
				curves = append(curves, uint16(c))
			}
			var sigs []uint16
			for _, s := range info.SignatureSchemes {
				sigs = append(sigs, uint16(s))
			}
			for _, c := range []struct {
				what      string
				ours, std any
			}{
				{"ciphers", hello.CipherSuites, info.CipherSuites},
				{"sni", hello.ServerName, info.ServerName},
				{"alpn", hello.ALPN, info.SupportedProtos},
				{"versions", hello.SupportedVersions, info.SupportedVersions},
				{"sigalgs", hello.SignatureAlgorithms, sigs},
				{"groups", hello.SupportedGroups, curves},
				{"points", hello.PointFormats, info.SupportedPoints},
				{"extensions", exts, info.Extensions},
			} {
				if !reflect.DeepEqual(c.ours, c.std) && !(reflect.ValueOf(c.ours).Len() == 0 && reflect.ValueOf(c.std).Len() == 0) {
					t.Errorf("%s: ours %v, crypto/tls %v", c.what, c.ours, c.std)
				}
			}
		})
	}
}

func TestPeekClientHelloNotTLS(t *testing.T) {
	cli, srv := net.Pipe()
	defer srv.Close()
	const req = "GET / HTTP/1.1\r\nHost: x\r\n\r\n"
	go func() { cli.Write([]byte(req)); cli.Close() }()
	conn, hello, err := PeekClientHello(srv)
	if !errors.Is(err, fingerprint.ErrNotHandshake) || hello != nil {
		t.Fatalf("PeekClientHello = %v, %v; want ErrNotHandshake", hello, err)
	}
	got, _ := io.ReadAll(conn)
	if string(got) != req {
		t.Fatalf("replayed %q, want %q", got, req)
	}
}

// shapeServer serves tapped plain connections with net/http (HTTP/1.1 and
// HTTP/2 with prior knowledge); each response is the JSON of the request's
// shape, and the request body is checked to arrive unchanged.
type shapeServer struct {
	ln  net.Listener
	srv *http.Server
	wg  sync.WaitGroup
}

type shapeReply struct {
	Shape  *fingerprint.Shape
	Body   string
	Akamai string
}

func startShapeServer(t *testing.T) *shapeServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetHTTP2(true) // net/http installs its HTTP/2 server only with this
	protocols.SetUnencryptedHTTP2(true)
	s := &shapeServer{ln: ln}
	type tapKey struct{}
	s.srv = &http.Server{
		Protocols: &protocols,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return context.WithValue(ctx, tapKey{}, c)
		},
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			tap := r.Context().Value(tapKey{}).(*Conn)
			body, _ := io.ReadAll(r.Body)
			reply := shapeReply{Shape: tap.Shape(r), Body: string(body)}
			if fp := tap.Fingerprint(); fp != nil && fp.H2 != nil {
				reply.Akamai = fp.H2.Akamai()
			}
			json.NewEncoder(w).Encode(reply)
		}),
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.srv.Serve(tapListener{ln})
	}()
	t.Cleanup(func() {
		s.srv.Close()
		s.wg.Wait()
	})
	return s
}

type tapListener struct{ net.Listener }

func (l tapListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return NewConn(c, nil), nil
}

func TestConnH1Shapes(t *testing.T) {
	s := startShapeServer(t)
	c, err := net.Dial("tcp", s.ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// Pipelined, with each body framing, and the stray CRLF after a POST
	// that net/http tolerates.
	reqs := "GET /one HTTP/1.1\r\nhost: x\r\nUser-Agent: curl/7.88.1\r\naccept: */*\r\n\r\n" +
		"POST /two HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nX-B: 1\r\n\r\nhello\r\n" +
		"POST /three HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nX-C: 1\r\n\r\n3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nTrailer-A: 1\r\n\r\n" +
		"GET /four HTTP/1.1\r\nX-Last: 1\r\nHOST: x\r\n\r\n"
	if _, err := io.WriteString(c, reqs); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	for _, want := range []shapeReply{
		{Shape: &fingerprint.Shape{HeaderOrder: []string{"host", "User-Agent", "accept"}}},
		{Shape: &fingerprint.Shape{HeaderOrder: []string{"Host", "Content-Length", "X-B"}}, Body: "hello"},
		{Shape: &fingerprint.Shape{HeaderOrder: []string{"Host", "Transfer-Encoding", "X-C"}}, Body: "abcde"},
		{Shape: &fingerprint.Shape{HeaderOrder: []string{"X-Last", "HOST"}}},
	} {
		got := readReply(t, br, nil)
		if !reflect.DeepEqual(got, want) {
			t.Errorf("got %+v, want %+v", got, want)
		}
	}

	// An upgrade turns the tap off: no shapes after, the bytes still flow.
	io.WriteString(c, "GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: nothing\r\nConnection: upgrade\r\n\r\n"+
		"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
	if got := readReply(t, br, nil); got.Shape == nil || got.Shape.HeaderOrder[2] != "Connection" {
		t.Errorf("upgrade request shape %+v", got.Shape)
	}
	if got := readReply(t, br, nil); got.Shape != nil {
		t.Errorf("a shape after an upgrade: %+v", got.Shape)
	}
}

func readReply(t *testing.T, br *bufio.Reader, req *http.Request) shapeReply {
	t.Helper()
	resp, err := http.ReadResponse(br, req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var r shapeReply
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		t.Fatal(err)
	}
	return r
}

// TestConnH2Shapes drives net/http's HTTP/2 server through the tap with a
// client whose frames are written here, so the wire order is known, with
// concurrent streams, CONTINUATIONs and a body.
func TestConnH2Shapes(t *testing.T) {
	s := startShapeServer(t)
	c, err := net.Dial("tcp", s.ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	bw := bufio.NewWriter(c)
	bw.WriteString(fingerprint.ClientPreface)
	fr := http2.NewFramer(bw, c)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	fr.WriteSettings(http2.Setting{ID: 1, Val: 65536}, http2.Setting{ID: 2, Val: 0}, http2.Setting{ID: 4, Val: 6291456}, http2.Setting{ID: 6, Val: 262144})
	fr.WriteWindowUpdate(0, 15663105)
	var hbuf bytes.Buffer
	enc := hpack.NewEncoder(&hbuf)
	orders := map[uint32][]string{}
	for i, stream := range []uint32{1, 3, 5} {
		hbuf.Reset()
		path := fmt.Sprintf("/s%d", stream)
		fields := []string{":method", "POST", ":authority", "x", ":scheme", "http", ":path", path}
		names := []string{"user-agent", "accept", fmt.Sprintf("x-%d", i), "cookie", "cookie"}
		for _, n := range names {
			fields = append(fields, n, strings.Repeat("v", 40*(i+1)))
		}
		for j := 0; j < len(fields); j += 2 {
			enc.WriteField(hpack.HeaderField{Name: fields[j], Value: fields[j+1]})
		}
		orders[stream] = names
		block := hbuf.Bytes()
		cut := len(block) / 2
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: stream, BlockFragment: block[:cut],
			Priority: http2.PriorityParam{Exclusive: true, Weight: 255}})
		fr.WriteContinuation(stream, true, block[cut:])
	}
	for _, stream := range []uint32{5, 1, 3} {
		fr.WriteData(stream, true, []byte(fmt.Sprintf("body-%d", stream)))
	}
	bw.Flush()

	got := map[uint32]shapeReply{}
	bodies := map[uint32]*bytes.Buffer{}
	for len(got) < 3 {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatal(err)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				fr.WriteSettingsAck()
				bw.Flush()
			}
		case *http2.MetaHeadersFrame:
			bodies[f.StreamID] = new(bytes.Buffer)
		case *http2.DataFrame:
			bodies[f.StreamID].Write(f.Data())
			if f.StreamEnded() {
				var r shapeReply
				if err := json.Unmarshal(bodies[f.StreamID].Bytes(), &r); err != nil {
					t.Fatal(err)
				}
				got[f.StreamID] = r
			}
		}
	}
	for stream, r := range got {
		if r.Shape == nil {
			t.Fatalf("stream %d: no shape", stream)
		}
		if !slices.Equal(r.Shape.HeaderOrder, orders[stream]) ||
			!slices.Equal(r.Shape.PseudoOrder, []string{":method", ":authority", ":scheme", ":path"}) ||
			r.Shape.Priority == nil || !r.Shape.Priority.Exclusive || r.Shape.Priority.Weight != 255 {
			t.Errorf("stream %d: shape %+v, want order %q", stream, r.Shape, orders[stream])
		}
		if want := fmt.Sprintf("body-%d", stream); r.Body != want {
			t.Errorf("stream %d: body %q, want %q", stream, r.Body, want)
		}
		if want := "1:65536;2:0;4:6291456;6:262144|15663105|0|m,a,s,p"; r.Akamai != want {
			t.Errorf("stream %d: Akamai %q", stream, r.Akamai)
		}
	}
}

// TestPeekClientHelloSplitRecords: a hello spread over several records,
// arriving a few bytes at a time, is read whole and replayed unchanged.
func TestPeekClientHelloSplitRecords(t *testing.T) {
	var rec []byte
	cli, srv := net.Pipe()
	go func() {
		tls.Client(cli, &tls.Config{ServerName: "split.test", NextProtos: []string{"h2"}}).Handshake()
		cli.Close()
	}()
	_, h, err := PeekClientHello(srv)
	srv.Close()
	if err != nil {
		t.Fatal(err)
	}
	msg := h.Raw[5:]
	for len(msg) > 0 { // records of 100 bytes of the message each
		k := min(100, len(msg))
		rec = append(rec, 22, 3, 1, byte(k>>8), byte(k))
		rec = append(rec, msg[:k]...)
		msg = msg[k:]
	}
	wire := append(rec, "after the hello"...)
	cli2, srv2 := net.Pipe()
	go func() {
		for b := wire; len(b) > 0; b = b[min(7, len(b)):] {
			cli2.Write(b[:min(7, len(b))])
		}
		cli2.Close()
	}()
	conn, got, err := PeekClientHello(srv2)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Raw, h.Raw) || got.ServerName != "split.test" {
		t.Errorf("split hello parsed differently")
	}
	all, _ := io.ReadAll(conn)
	if !bytes.Equal(all, wire) {
		t.Errorf("replayed %d bytes, want %d", len(all), len(wire))
	}
}

// TestPeekClientHelloTinyRecords: the largest hello that fits the read
// bound when every record carries one byte of it (11,000 records) is read
// whole and replayed unchanged. Finding each next record by walking the
// buffer from its start made this a second of CPU.
func TestPeekClientHelloTinyRecords(t *testing.T) {
	const msgLen = (fingerprint.MaxHelloLen + 1024) / 6 // 5 header bytes per byte of hello
	body := []byte{3, 3}
	body = append(body, make([]byte, 32)...)       // random
	body = append(body, 0, 0, 2, 0x13, 0x01, 1, 0) // no session id, one suite, null compression
	pad := msgLen - 4 - len(body) - 2 - 4          // an unknown extension fills the rest
	body = binary.BigEndian.AppendUint16(body, uint16(4+pad))
	body = append(body, 0xff, 0xee, byte(pad>>8), byte(pad))
	body = append(body, bytes.Repeat([]byte{'p'}, pad)...)
	msg := append([]byte{1, 0, byte(len(body) >> 8), byte(len(body))}, body...)
	var wire []byte
	for _, b := range msg {
		wire = append(wire, 22, 3, 1, 0, 1, b)
	}
	wire = append(wire, "after the hello"...)

	cli, srv := net.Pipe()
	defer srv.Close()
	go func() {
		cli.Write(wire)
		cli.Close()
	}()
	conn, h, err := PeekClientHello(srv)
	if err != nil {
		t.Fatal(err)
	}
	if want := append([]byte{22, 3, 1, byte(len(msg) >> 8), byte(len(msg))}, msg...); !bytes.Equal(h.Raw, want) {
		t.Errorf("Raw is not the hello in one record")
	}
	if x, ok := h.Extension(0xffee); !ok || len(x.Data) != pad {
		t.Errorf("padding extension %v, %d bytes", ok, len(x.Data))
	}
	all, _ := io.ReadAll(conn)
	if !bytes.Equal(all, wire) {
		t.Errorf("replayed %d bytes, want %d", len(all), len(wire))
	}
}
