package proxy_test

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// h2Through opens a CONNECT tunnel to host, speaks TLS with ALPN h2 inside
// it and sends the client preface: a raw HTTP/2 connection to the MITM.
func h2Through(t *testing.T, w *world, host string) (*tls.Conn, *http2.Framer) {
	t.Helper()
	conn, br := connectTunnel(t, w, host)
	t.Cleanup(func() { conn.Close() })
	name, _, _ := net.SplitHostPort(host)
	tc := tls.Client(&bufConn{Conn: conn, r: br}, &tls.Config{ServerName: name, RootCAs: w.caPool, NextProtos: []string{"h2"}})
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	if tc.ConnectionState().NegotiatedProtocol != "h2" {
		t.Fatal("no h2 through the MITM")
	}
	if _, err := io.WriteString(tc, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(tc, tc)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	return tc, fr
}

// readUntilGone reads the server's frames until it closes the connection
// or sends GOAWAY, and says which; it gives up after d.
func readUntilGone(tc *tls.Conn, fr *http2.Framer, d time.Duration) string {
	_ = tc.SetReadDeadline(time.Now().Add(d))
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				return "still open"
			}
			return "closed"
		}
		if ga, ok := f.(*http2.GoAwayFrame); ok {
			return "goaway " + ga.ErrCode.String()
		}
	}
}

// heapInUse is the live heap after a collection.
func heapInUse() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapInuse
}

// TestHTTP2HostileFrames: HTTP/2 floods through the MITM written with
// x/net/http2's Framer: a SETTINGS flood, a CONTINUATION flood (a header
// block that never ends) and an oversized header block. Each is cut off by
// the tunnel's HTTP/2 server (GOAWAY or a closed connection) or absorbed,
// the process does not crash, memory stays bounded, and another client is
// served meanwhile. (Rapid reset has its own test.)
func TestHTTP2HostileFrames(t *testing.T) {
	origin := tlsOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "page")
	}), false)
	w := newWorld(t, worldOpts{
		originCAs: []*x509.Certificate{origin.Certificate()},
		dedup:     dedupOn(dedup.Config{}),
		quiet:     true,
	})
	host := strings.TrimPrefix(origin.URL, "https://")
	other := w.client(true)
	other.Transport.(*http.Transport).DialContext = (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}).DialContext
	stillServes := func(t *testing.T) {
		t.Helper()
		if resp, body := w.get(other, origin.URL+"/other"); resp.StatusCode != 200 || body != "page" {
			t.Fatalf("another client: %d %q", resp.StatusCode, body)
		}
	}
	headerBlock := func(enc *hpack.Encoder, buf *bytes.Buffer, extra ...hpack.HeaderField) []byte {
		buf.Reset()
		for _, kv := range [][2]string{{":method", "GET"}, {":scheme", "https"}, {":authority", host}, {":path", "/hostile"}} {
			enc.WriteField(hpack.HeaderField{Name: kv[0], Value: kv[1]})
		}
		for _, f := range extra {
			enc.WriteField(f)
		}
		return buf.Bytes()
	}
	const heapBound = 64 << 20

	t.Run("settings flood", func(t *testing.T) {
		before := heapInUse()
		tc, fr := h2Through(t, w, host)
		// Write without reading the server's ACKs: the server must not
		// queue acknowledgements without bound.
		var sent atomic.Int64
		done := make(chan struct{})
		go func() {
			defer close(done)
			for range 50_000 {
				if err := fr.WriteSettings(http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: 100}); err != nil {
					return
				}
				sent.Add(1)
			}
		}()
		stillServes(t)
		<-done
		got := readUntilGone(tc, fr, 10*time.Second)
		t.Logf("%d SETTINGS frames sent: %s", sent.Load(), got)
		if got == "still open" && sent.Load() == 50_000 {
			// Absorbed: every ACK was queued and written; that is bounded
			// only if the heap says so.
			t.Log("the flood was absorbed")
		}
		if grew := int64(heapInUse()) - int64(before); grew > heapBound {
			t.Fatalf("heap grew by %d MiB during a SETTINGS flood", grew>>20)
		}
		stillServes(t)
	})

	t.Run("continuation flood", func(t *testing.T) {
		before := heapInUse()
		tc, fr := h2Through(t, w, host)
		var hb bytes.Buffer
		enc := hpack.NewEncoder(&hb)
		block := headerBlock(enc, &hb)
		if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block, EndStream: true, EndHeaders: false}); err != nil {
			t.Fatal(err)
		}
		// Endless CONTINUATION frames, each a valid literal header: the
		// block never ends, so only a size bound can stop it.
		hb.Reset()
		enc.WriteField(hpack.HeaderField{Name: "x-flood", Value: strings.Repeat("a", 1000)})
		frag := append([]byte(nil), hb.Bytes()...)
		var sent int64
		errc := make(chan error, 1)
		go func() {
			for sent = 0; sent < 100_000; sent++ { // 100 MB if nothing stops it
				if err := fr.WriteContinuation(1, false, frag); err != nil {
					errc <- err
					return
				}
			}
			errc <- nil
		}()
		got := readUntilGone(tc, fr, 30*time.Second)
		werr := <-errc
		t.Logf("CONTINUATION flood: %s after %d frames (%d KiB); writer: %v", got, sent, sent*int64(len(frag))>>10, werr)
		if got == "still open" {
			t.Fatal("an endless header block did not end the connection")
		}
		if sent >= 100_000 {
			t.Fatal("the server read 100 MB of one header block")
		}
		if grew := int64(heapInUse()) - int64(before); grew > heapBound {
			t.Fatalf("heap grew by %d MiB during a CONTINUATION flood", grew>>20)
		}
		stillServes(t)
	})

	t.Run("oversized header block", func(t *testing.T) {
		tc, fr := h2Through(t, w, host)
		var hb bytes.Buffer
		enc := hpack.NewEncoder(&hb)
		// 1 MiB of headers in one block, over proxy.max_header_bytes.
		var fields []hpack.HeaderField
		for i := range 1024 {
			fields = append(fields, hpack.HeaderField{Name: fmt.Sprintf("x-h%d", i), Value: strings.Repeat("b", 1024)})
		}
		block := headerBlock(enc, &hb, fields...)
		// Split into frames the server accepts (16 KiB default).
		const max = 16 << 10
		first := block[:max]
		if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: first, EndStream: true, EndHeaders: false}); err != nil {
			t.Fatal(err)
		}
		rest := block[max:]
		for len(rest) > 0 {
			n := min(max, len(rest))
			if err := fr.WriteContinuation(1, n == len(rest), rest[:n]); err != nil {
				break // the server hung up: fine
			}
			rest = rest[n:]
		}
		_ = tc.SetReadDeadline(time.Now().Add(15 * time.Second))
		status := ""
		for status == "" {
			f, err := fr.ReadFrame()
			if err != nil {
				status = "closed"
				break
			}
			switch f := f.(type) {
			case *http2.GoAwayFrame:
				status = "goaway " + f.ErrCode.String()
			case *http2.RSTStreamFrame:
				status = "reset " + f.ErrCode.String()
			case *http2.HeadersFrame:
				// A 431 answer is fine too; a 200 is not.
				dec := hpack.NewDecoder(4096, nil)
				hf, _ := dec.DecodeFull(f.HeaderBlockFragment())
				for _, h := range hf {
					if h.Name == ":status" {
						status = "status " + h.Value
					}
				}
			}
		}
		t.Logf("1 MiB header block: %s", status)
		if status == "status 200" {
			t.Fatal("a 1 MiB header block was served")
		}
		stillServes(t)
	})
}
