package proxy_test

import (
	"bytes"
	"crypto/x509"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestHTTP2ZeroWindowClientIsGivenUp: an HTTP/2 client of the MITM that
// sets its streams' initial window to zero and never sends WINDOW_UPDATE,
// while it keeps its connection busy (PINGs, read and answered), lets no
// byte of its response out. Its stream must be given up once no byte has
// moved for proxy.idle_timeout, and its handler return; the connection's
// own idle timeout never fires, since the connection is not idle. The
// other client on the same flight gets its whole body meanwhile. It was
// held for as long as the client cared to ping.
func TestHTTP2ZeroWindowClientIsGivenUp(t *testing.T) {
	const size = 256 << 10
	release := make(chan struct{})
	origin := tlsOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-release // until both clients are on the flight
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Write(bytes.Repeat([]byte("x"), size))
	}), false)
	var once sync.Once
	open := func() { once.Do(func() { close(release) }) }
	t.Cleanup(open)
	w := newWorld(t, worldOpts{
		proxy:     proxy.Config{IdleTimeout: time.Second},
		originCAs: []*x509.Certificate{origin.Certificate()},
		dedup:     dedupOn(dedup.Config{}),
	})
	host := strings.TrimPrefix(origin.URL, "https://")

	reset := zeroWindowRequest(t, w, host, [][2]string{{":method", "GET"}, {":scheme", "https"}, {":authority", host}, {":path", "/big"}})
	testkit.Eventually(t, 10*time.Second, func() bool { return w.srv.Inflight() == 1 }, "the stuck client's request")

	got := make(chan string, 1)
	go func() {
		resp, body := w.get(w.client(true), origin.URL+"/big")
		if len(body) != size {
			t.Errorf("the other client got %d of %d bytes", len(body), size)
		}
		got <- resp.Header.Get("X-Cache")
	}()
	testkit.Eventually(t, 10*time.Second, func() bool { return w.srv.Inflight() == 2 }, "the other client's request")
	time.Sleep(100 * time.Millisecond) // on the flight, not only in the handler
	open()
	if xc := <-got; xc != "COALESCED" {
		t.Errorf("the other client's X-Cache: %q, want COALESCED (on the stuck client's flight)", xc)
	}

	start := time.Now()
	select {
	case code := <-reset:
		t.Logf("stream reset (%v) after %v", code, time.Since(start))
	case <-time.After(6 * time.Second):
		t.Fatal("the stream of a client that never opens its window was still held 6s after its response began (idle_timeout 1s)")
	}
	testkit.Eventually(t, 5*time.Second, func() bool { return w.srv.Inflight() == 0 }, "the stuck stream's handler to return")
}

// TestHTTP2SlowBodyIsNotCut: the stream deadline is an idle one, pushed
// on by every write: a body that trickles in over several idle timeouts,
// a piece every 100 ms, reaches an HTTP/2 client whole.
func TestHTTP2SlowBodyIsNotCut(t *testing.T) {
	origin := tlsOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for range 25 { // 2.5 s in all
			w.Write(bytes.Repeat([]byte("x"), 8<<10))
			w.(http.Flusher).Flush()
			time.Sleep(100 * time.Millisecond)
		}
	}), false)
	w := newWorld(t, worldOpts{
		proxy:     proxy.Config{IdleTimeout: time.Second},
		originCAs: []*x509.Certificate{origin.Certificate()},
	})
	resp, body := w.get(w.client(true), origin.URL+"/slow")
	if resp.ProtoMajor != 2 || len(body) != 25*8<<10 {
		t.Fatalf("HTTP/%d, %d bytes, want HTTP/2 and %d", resp.ProtoMajor, len(body), 25*8<<10)
	}
}

// zeroWindowRequest sends a request (its pseudo-headers and headers,
// fields) to the MITM as an HTTP/2 client whose streams' initial window is
// zero and that never sends WINDOW_UPDATE, though it reads all, answers
// SETTINGS and keeps its connection busy with a PING every 100 ms until
// the test ends. The returned channel gets the code of a RST_STREAM of the
// request's stream.
func zeroWindowRequest(t *testing.T, w *world, host string, fields [][2]string) <-chan http2.ErrCode {
	t.Helper()
	tc, fr := h2Through(t, w, host)
	var mu sync.Mutex // the Framer's writes: the test's and the reader's
	write := func(f func() error) {
		mu.Lock()
		defer mu.Unlock()
		_ = f()
	}
	write(func() error { return fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0}) })
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for _, kv := range fields {
		enc.WriteField(hpack.HeaderField{Name: kv[0], Value: kv[1]})
	}
	write(func() error {
		return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndStream: true, EndHeaders: true})
	})
	reset := make(chan http2.ErrCode, 1)
	go func() { // reads everything, acknowledges SETTINGS, opens no window
		_ = tc.SetReadDeadline(time.Now().Add(time.Minute))
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return
			}
			switch f := f.(type) {
			case *http2.SettingsFrame:
				if !f.IsAck() {
					write(fr.WriteSettingsAck)
				}
			case *http2.RSTStreamFrame:
				if f.StreamID == 1 {
					reset <- f.ErrCode
				}
			}
		}
	}()
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	go func() { // the connection is never idle
		for i := uint64(0); ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			write(func() error { return fr.WritePing(false, [8]byte{byte(i)}) })
		}
	}()
	return reset
}

// TestHTTP2ZeroWindowErrorAnswerIsGivenUp: the answers the MITM makes
// itself (here the 400 for a CONNECT inside the tunnel) are bounded the
// same way as the proxied ones.
func TestHTTP2ZeroWindowErrorAnswerIsGivenUp(t *testing.T) {
	w := newWorld(t, worldOpts{proxy: proxy.Config{IdleTimeout: time.Second}})
	reset := zeroWindowRequest(t, w, "127.0.0.1:443", [][2]string{{":method", "CONNECT"}, {":authority", "example.com:443"}})
	select {
	case <-reset:
	case <-time.After(6 * time.Second):
		t.Fatal("the 400 to a client that never opens its window was still held after 6s (idle_timeout 1s)")
	}
}
