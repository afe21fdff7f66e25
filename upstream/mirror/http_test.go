package mirror

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/fporigin"
)

// pattern is byte i of a /big body.
func pattern(i int64) byte { return byte(i % 251) }

// testHandler serves the bodies the HTTP tests need:
//
//	/big?n=N  N pattern bytes with a Content-Length
//	/echo     the request body's length and SHA-256, with a trailer
//	/hold     waits until the request is cancelled
//	/huge-header  a 2 MiB response header
func testHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/big", func(w http.ResponseWriter, r *http.Request) {
		n, _ := strconv.ParseInt(r.URL.Query().Get("n"), 10, 64)
		w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
		buf := make([]byte, 32<<10)
		for off := int64(0); off < n; {
			k := min(int64(len(buf)), n-off)
			for i := range buf[:k] {
				buf[i] = pattern(off + int64(i))
			}
			if _, err := w.Write(buf[:k]); err != nil {
				return
			}
			off += k
		}
	})
	mux.HandleFunc("/echo", func(w http.ResponseWriter, r *http.Request) {
		h := sha256.New()
		n, err := io.Copy(h, r.Body)
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.Header().Set("Trailer", "X-Sum")
		fmt.Fprintf(w, "%d %x %s", n, h.Sum(nil), r.Trailer.Get("X-Req-Trailer"))
		w.Header().Set("X-Sum", hex.EncodeToString(h.Sum(nil)))
	})
	mux.HandleFunc("/hold", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	})
	mux.HandleFunc("/huge-header", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Huge", strings.Repeat("x", 2<<20))
	})
	mux.HandleFunc("/refuse-body", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusUnauthorized) // without reading the body
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	return mux
}

// readBig reads a /big body of n bytes, checking every byte, with pause
// between reads of at most chunk bytes.
func readBig(t *testing.T, body io.Reader, n int64, chunk int, pause time.Duration) error {
	t.Helper()
	buf := make([]byte, chunk)
	var off int64
	for {
		k, err := body.Read(buf)
		for i := range buf[:k] {
			if buf[i] != pattern(off+int64(i)) {
				return fmt.Errorf("byte %d is %d, want %d", off+int64(i), buf[i], pattern(off+int64(i)))
			}
		}
		off += int64(k)
		if err == io.EOF {
			if off != n {
				return fmt.Errorf("EOF after %d of %d bytes", off, n)
			}
			return nil
		}
		if err != nil {
			return fmt.Errorf("after %d of %d bytes: %w", off, n, err)
		}
		if pause > 0 {
			time.Sleep(pause)
		}
	}
}

// TestH2SlowReaderChromeWindow reads a 24 MiB body slowly over a
// connection that announced Chrome's 6 MiB stream window: the origin may
// have 6 MiB in flight, and the body must arrive whole. (fhttp's HTTP/2
// transport fails here with FLOW_CONTROL_ERROR after about 4.2 MiB: it
// announces the window but credits the stream 4 MiB.)
func TestH2SlowReaderChromeWindow(t *testing.T) {
	o := startOrigin(t, fporigin.Options{Handler: testHandler()})
	cc, _ := openConn(t, o, goHello(t, "h2", "http/1.1"), chromeH2, Options{})
	if _, ok := cc.(*H2Conn); !ok {
		t.Fatalf("%T, want *H2Conn", cc)
	}
	const n = 24 << 20
	ctx := ctxTimeout(t, 2*time.Minute)
	resp, err := cc.RoundTrip(newRequest(t, ctx, "GET", o.URL()+"/big?n="+strconv.Itoa(n), nil))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.ContentLength != n || resp.ProtoMajor != 2 {
		t.Fatalf("response %s, length %d", resp.Proto, resp.ContentLength)
	}
	start := time.Now()
	// 256 KiB every 20 ms: about 12 MiB/s, slower than loopback delivers,
	// so the stream window is full most of the time.
	if err := readBig(t, resp.Body, n, 256<<10, 20*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	t.Logf("24 MiB read slowly in %v", time.Since(start).Round(time.Millisecond))
	if got := o.Records()[0].Akamai; got != chromeAkamai {
		t.Errorf("origin saw Akamai %s, want %s", got, chromeAkamai)
	}
}

// TestH2ShapeOnTheWire: pseudo-header order, header order (cookie crumbs
// included), and a priority block that is all zeros reach the origin as
// given; nothing is added (no accept-encoding).
func TestH2ShapeOnTheWire(t *testing.T) {
	o := startOrigin(t, fporigin.Options{Handler: testHandler()})
	cc, _ := openConn(t, o, goHello(t, "h2"), chromeH2, Options{})
	shape := &fingerprint.Shape{
		PseudoOrder: []string{":method", ":path", ":authority", ":scheme"},
		HeaderOrder: []string{"user-agent", "cookie", "accept", "x-b", "cookie"},
		Priority:    &fingerprint.Priority{}, // weight 1, no dependency: x/net's Framer would drop it
	}
	req := newRequest(t, ctxTimeout(t, 10*time.Second), "GET", o.URL()+"/", shape)
	req.Header.Set("Accept", "*/*")
	req.Header.Set("User-Agent", "ua")
	req.Header.Set("X-B", "1")
	req.Header.Set("Cookie", "a=1; b=2")
	req.Header.Set("Connection", "keep-alive") // connection-specific: never on HTTP/2
	resp, err := cc.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	rec := o.Records()[0]
	if rec.Shape == nil {
		t.Fatal("no shape recorded")
	}
	if !slices.Equal(rec.Shape.PseudoOrder, shape.PseudoOrder) || !slices.Equal(rec.Shape.HeaderOrder, shape.HeaderOrder) {
		t.Errorf("origin saw %q %q, want %q %q", rec.Shape.PseudoOrder, rec.Shape.HeaderOrder, shape.PseudoOrder, shape.HeaderOrder)
	}
	if p := rec.Shape.Priority; p == nil || *p != (fingerprint.Priority{}) {
		t.Errorf("priority %+v, want the zero block", p)
	}
	if rec.Header.Get("Accept-Encoding") != "" || rec.Header.Get("Cookie") != "a=1; b=2" {
		t.Errorf("header at the origin %v", rec.Header)
	}
	// The HEADERS priority of the preface applies when the request has no
	// shape.
	getRoot(t, cc, o)
	if p := o.Records()[1].Shape.Priority; p == nil || *p != *chromeH2.HeaderPriority {
		t.Errorf("priority without a shape %+v", p)
	}
}

// TestH2StreamDependenciesRenumbered: a browser's HEADERS depend on its
// previous stream on its own connection to the proxy; those numbers mean
// nothing here, and one may even be the new stream's own id here, which an
// origin answers with PROTOCOL_ERROR. The dependency becomes the stream
// opened before on this connection (none for the first); one on a stream
// of the preface's PRIORITY frames stays.
func TestH2StreamDependenciesRenumbered(t *testing.T) {
	o := startOrigin(t, fporigin.Options{Handler: testHandler()})
	pre := *chromeH2
	pre.Priorities = []fingerprint.Priority{{StreamID: 11, StreamDep: 0, Weight: 100}}
	pre.FirstStreamID = 13
	cc, _ := openConn(t, o, goHello(t, "h2"), &pre, Options{})
	for i, tc := range []struct{ dep, want uint32 }{
		{15, 0},  // the first stream (13) has none before it
		{15, 13}, // a client's dependency that is this stream's own id here
		{11, 11}, // a stream of the preface's PRIORITY frames
		{0, 0},
	} {
		shape := &fingerprint.Shape{
			PseudoOrder: []string{":method", ":authority", ":scheme", ":path"},
			HeaderOrder: []string{"user-agent"},
			Priority:    &fingerprint.Priority{Exclusive: true, StreamDep: tc.dep, Weight: 219},
		}
		req := newRequest(t, ctxTimeout(t, 10*time.Second), "GET", fmt.Sprintf("%s/dep-%d", o.URL(), i), shape)
		resp, err := cc.RoundTrip(req)
		if err != nil {
			t.Fatalf("request %d (dependency %d): %v", i, tc.dep, err)
		}
		resp.Body.Close()
		rec := o.Records()[i]
		if p := rec.Shape.Priority; p == nil || p.StreamDep != tc.want || !p.Exclusive || p.Weight != 219 {
			t.Errorf("request %d: priority %+v, want exclusive dependency %d weight 219", i, p, tc.want)
		}
	}
}

// TestH2ConcurrentFlowControl: many streams at once on small windows
// (the default 64 KiB for stream and connection, and an origin allowing
// two streams), downloads and uploads, every byte checked.
func TestH2ConcurrentFlowControl(t *testing.T) {
	o := startOrigin(t, fporigin.Options{Handler: testHandler(), MaxConcurrentStreams: 2})
	small := &fingerprint.H2{PseudoOrder: chromeH2.PseudoOrder, FirstStreamID: 1} // no settings: RFC defaults
	cc, _ := openConn(t, o, goHello(t, "h2"), small, Options{})
	ctx := ctxTimeout(t, time.Minute)
	var wg sync.WaitGroup
	errs := make(chan error, 24)
	for i := range 12 {
		wg.Add(2)
		go func() {
			defer wg.Done()
			n := int64(300<<10 + i*1000)
			resp, err := cc.RoundTrip(newRequest(t, ctx, "GET", fmt.Sprintf("%s/big?n=%d", o.URL(), n), nil))
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			if err := readBig(t, resp.Body, n, 7000, 0); err != nil {
				errs <- err
			}
		}()
		go func() {
			defer wg.Done()
			body := bytes.Repeat([]byte{byte(i)}, 200<<10+i)
			req := newRequest(t, ctx, "POST", o.URL()+"/echo", nil)
			req.Body = io.NopCloser(bytes.NewReader(body))
			req.ContentLength = int64(len(body))
			if i%2 == 1 { // unknown length
				req.ContentLength = 0
				req.Body = io.NopCloser(io.MultiReader(bytes.NewReader(body[:1000]), bytes.NewReader(body[1000:])))
			}
			resp, err := cc.RoundTrip(req)
			if err != nil {
				errs <- err
				return
			}
			got, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			sum := sha256.Sum256(body)
			if want := fmt.Sprintf("%d %x ", len(body), sum); err != nil || string(got) != want {
				errs <- fmt.Errorf("echo %q, %v; want %q", got, err, want)
			}
			if resp.Trailer.Get("X-Sum") != hex.EncodeToString(sum[:]) {
				errs <- fmt.Errorf("trailer %v", resp.Trailer)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestH2CancelAndEarlyClose: a cancelled request and bodies closed early
// reset their streams and give their buffered bytes back to the
// connection window, which then still carries a full download.
func TestH2CancelAndEarlyClose(t *testing.T) {
	o := startOrigin(t, fporigin.Options{Handler: testHandler()})
	small := &fingerprint.H2{Settings: []fingerprint.Setting{{ID: 4, Val: 1 << 20}}, PseudoOrder: chromeH2.PseudoOrder}
	cc, _ := openConn(t, o, goHello(t, "h2"), small, Options{})
	ctx := ctxTimeout(t, 30*time.Second)

	rctx, cancel := context.WithCancel(ctx)
	resp, err := cc.RoundTrip(newRequest(t, rctx, "GET", o.URL()+"/big?n=10000000", nil))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1000)
	if _, err := io.ReadFull(resp.Body, buf); err != nil {
		t.Fatal(err)
	}
	cancel()
	if _, err := io.ReadAll(resp.Body); !errors.Is(err, context.Canceled) {
		t.Errorf("read after cancel: %v", err)
	}
	resp.Body.Close()

	for range 5 {
		resp, err := cc.RoundTrip(newRequest(t, ctx, "GET", o.URL()+"/big?n=1000000", nil))
		if err != nil {
			t.Fatal(err)
		}
		io.ReadFull(resp.Body, buf)
		time.Sleep(20 * time.Millisecond) // let the connection window fill
		resp.Body.Close()
	}
	resp, err = cc.RoundTrip(newRequest(t, ctx, "GET", o.URL()+"/big?n=3000000", nil))
	if err != nil {
		t.Fatal(err)
	}
	if err := readBig(t, resp.Body, 3000000, 64<<10, 0); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if !cc.CanTakeRequest() {
		t.Error("the connection is no longer usable")
	}
}

// TestH1OrderCaseAndReuse: the fields reach the origin in the shape's
// order and case, repeated names where the client had each; the
// connection carries the next request.
func TestH1OrderCaseAndReuse(t *testing.T) {
	o := startOrigin(t, fporigin.Options{Handler: testHandler()})
	cc, _ := openConn(t, o, goHello(t, "http/1.1"), nil, Options{})
	if _, ok := cc.(*H1Conn); !ok {
		t.Fatalf("%T, want *H1Conn", cc)
	}
	shape := &fingerprint.Shape{HeaderOrder: []string{"user-AGENT", "X-Z", "host", "accept", "X-Z"}}
	for i := range 2 {
		req := newRequest(t, ctxTimeout(t, 10*time.Second), "GET", o.URL()+"/", shape)
		req.Header["X-Z"] = []string{"1", "2"}
		req.Header.Set("User-Agent", "curl/7.88.1")
		req.Header.Set("Accept", "*/*")
		req.Header.Set("X-Added", "by the proxy")
		resp, err := cc.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		if b, _ := io.ReadAll(resp.Body); string(b) != "ok" {
			t.Fatalf("body %q", b)
		}
		resp.Body.Close()
		rec := o.Records()[i]
		want := []string{"user-AGENT", "X-Z", "host", "accept", "X-Z", "X-Added"}
		if rec.Shape == nil || !slices.Equal(rec.Shape.HeaderOrder, want) {
			t.Errorf("request %d: origin saw %+v, want %q", i, rec.Shape, want)
		}
		if !slices.Equal(rec.Header["X-Z"], []string{"1", "2"}) || rec.Proto != "HTTP/1.1" {
			t.Errorf("request %d: %s X-Z %q", i, rec.Proto, rec.Header["X-Z"])
		}
		if rec.Conn != o.Records()[0].Conn {
			t.Errorf("request %d came on connection %d, not reused", i, rec.Conn)
		}
	}
}

// TestH1Bodies: known and unknown lengths, Expect: 100-continue, and an
// origin that answers without wanting the body.
func TestH1Bodies(t *testing.T) {
	o := startOrigin(t, fporigin.Options{Handler: testHandler()})
	cc, _ := openConn(t, o, goHello(t, "http/1.1"), nil, Options{ExpectContinueTimeout: 5 * time.Second})
	ctx := ctxTimeout(t, 20*time.Second)
	body := bytes.Repeat([]byte("0123456789"), 50000)
	sum := sha256.Sum256(body)
	want := fmt.Sprintf("%d %x ", len(body), sum)
	for _, tc := range []struct {
		name   string
		length int64
		expect bool
		shape  *fingerprint.Shape
	}{
		{"content-length", int64(len(body)), false, &fingerprint.Shape{HeaderOrder: []string{"Host", "Content-Length", "X-A"}}},
		{"chunked", -1, false, &fingerprint.Shape{HeaderOrder: []string{"Host", "Transfer-Encoding", "X-A"}}},
		{"unknown length goes chunked", 0, false, &fingerprint.Shape{HeaderOrder: []string{"Host", "Transfer-Encoding", "X-A"}}},
		{"expect 100-continue", int64(len(body)), true, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o.Reset()
			req := newRequest(t, ctx, "POST", o.URL()+"/echo", tc.shape)
			req.Body = io.NopCloser(bytes.NewReader(body))
			req.ContentLength = tc.length
			req.Header.Set("X-A", "1")
			if tc.expect {
				req.Header.Set("Expect", "100-continue")
			}
			if tc.length == 0 {
				req.Trailer = http.Header{"X-Req-Trailer": {"t"}}
			}
			resp, err := cc.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			got, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			w := want
			if tc.length == 0 {
				w += "t"
			}
			if err != nil || string(got) != w {
				t.Errorf("echo %q, %v; want %q", got, err, w)
			}
			if resp.Trailer.Get("X-Sum") != hex.EncodeToString(sum[:]) {
				t.Errorf("trailer %v", resp.Trailer)
			}
			if tc.shape != nil {
				if rec := o.Records()[0]; rec.Shape == nil || !slices.Equal(rec.Shape.HeaderOrder, tc.shape.HeaderOrder) {
					t.Errorf("origin saw %+v, want %q", rec.Shape, tc.shape.HeaderOrder)
				}
			}
		})
	}
	// A final answer before 100 Continue: the body is not sent, and the
	// connection, in an unknown state, is not reused.
	req := newRequest(t, ctx, "POST", o.URL()+"/refuse-body", nil)
	req.Body = io.NopCloser(bytes.NewReader(body))
	req.ContentLength = int64(len(body))
	req.Header.Set("Expect", "100-continue")
	resp, err := cc.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized || cc.CanTakeRequest() {
		t.Errorf("status %d; reusable %v", resp.StatusCode, cc.CanTakeRequest())
	}
}

// TestH1Limits: an oversized response header and a cancelled request end
// the connection with an error, not a hang or a crash.
func TestH1Limits(t *testing.T) {
	o := startOrigin(t, fporigin.Options{Handler: testHandler()})
	cc, _ := openConn(t, o, goHello(t, "http/1.1"), nil, Options{MaxResponseHeaderBytes: 64 << 10})
	_, err := cc.RoundTrip(newRequest(t, ctxTimeout(t, 10*time.Second), "GET", o.URL()+"/huge-header", nil))
	if err == nil || !strings.Contains(err.Error(), "header") || cc.CanTakeRequest() {
		t.Errorf("huge header: %v, reusable %v", err, cc.CanTakeRequest())
	}

	cc, _ = openConn(t, o, goHello(t, "http/1.1"), nil, Options{})
	ctx, cancel := context.WithCancel(ctxTimeout(t, 10*time.Second))
	resp, err := cc.RoundTrip(newRequest(t, ctx, "GET", o.URL()+"/hold", nil))
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	if _, err := io.ReadAll(resp.Body); err == nil || cc.CanTakeRequest() {
		t.Errorf("cancelled body read: %v, reusable %v", err, cc.CanTakeRequest())
	}
	resp.Body.Close()
	if _, err := cc.RoundTrip(newRequest(t, context.Background(), "GET", o.URL()+"/", nil)); !errors.Is(err, ErrUnprocessed) {
		t.Errorf("request on a closed connection: %v", err)
	}
}

// TestH1NoResponse: a connection that ends before any byte of the
// response (an origin that closed it while idle, as it read the request)
// fails the request with ErrNoResponse: a caller may send a repeatable
// request again on a new connection. One that breaks off in the middle of a
// response head is an error of its own.
func TestH1NoResponse(t *testing.T) {
	for _, tc := range []struct {
		name     string
		second   string // what the origin writes for the second request before closing
		noAnswer bool
	}{
		{"closed before an answer", "", true},
		{"cut in the response head", "HTTP/1.1 20", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			go func() {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				defer c.Close()
				br := bufio.NewReader(c)
				if _, err := http.ReadRequest(br); err != nil {
					return
				}
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
				if _, err := http.ReadRequest(br); err != nil {
					return
				}
				io.WriteString(c, tc.second)
			}()
			c, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			cc := NewH1Conn(c, Options{})
			defer cc.Close()
			ctx := ctxTimeout(t, 10*time.Second)
			resp, err := cc.RoundTrip(newRequest(t, ctx, "GET", "http://"+ln.Addr().String()+"/a", nil))
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			_, err = cc.RoundTrip(newRequest(t, ctx, "GET", "http://"+ln.Addr().String()+"/b", nil))
			if err == nil || errors.Is(err, ErrNoResponse) != tc.noAnswer || errors.Is(err, ErrUnprocessed) {
				t.Fatalf("second request: %v, want ErrNoResponse: %v", err, tc.noAnswer)
			}
		})
	}
}
