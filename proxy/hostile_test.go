package proxy_test

import (
	"bufio"
	"bytes"
	"context"
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

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// rawExchange writes raw to the proxy port and reads one response.
func rawExchange(t *testing.T, addr, raw string) (*http.Response, string) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(conn, raw); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no response: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

func TestOversizedURLAndHeaders(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{})
	long := strings.Repeat("a", 100<<10)
	for _, raw := range []string{
		"GET " + origin.URL + "/" + long + " HTTP/1.1\r\nHost: x\r\n\r\n",
		"GET " + origin.URL + "/ HTTP/1.1\r\nHost: x\r\n" + strings.Repeat("X-Many: 0123456789012345678901234567890123456789\r\n", 2000) + "\r\n",
	} {
		if resp, _ := rawExchange(t, w.proxyURL.Host, raw); resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
			t.Fatalf("status %d, want 431", resp.StatusCode)
		}
	}
	if resp, _ := w.get(w.client(false), origin.URL+"/fine"); resp.StatusCode != 200 {
		t.Fatal("proxy stopped serving")
	}
}

// TestSlowloris: a client that dribbles its headers is cut at the header
// timeout while other clients are served normally.
func TestSlowloris(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{proxy: proxy.Config{ReadHeaderTimeout: 300 * time.Millisecond}})
	conn, err := net.Dial("tcp", w.proxyURL.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "GET %s/ HTTP/1.1\r\nHost: x\r\n", origin.URL)
	cut := make(chan time.Duration, 1)
	start := time.Now()
	go func() {
		// One header byte every 50ms: always active, never done.
		for {
			if _, err := conn.Write([]byte("X")); err != nil {
				cut <- time.Since(start)
				return
			}
			time.Sleep(50 * time.Millisecond)
			if time.Since(start) > 10*time.Second {
				cut <- -1
				return
			}
		}
	}()
	if resp, _ := w.get(w.client(false), origin.URL+"/meanwhile"); resp.StatusCode != 200 {
		t.Fatalf("other client: %d", resp.StatusCode)
	}
	if d := <-cut; d < 0 {
		t.Fatal("a slowloris client was never cut")
	}
}

// TestTLSWithoutSNI: a client that sends no SNI (an IP target) gets a leaf
// for the CONNECT host, with an IP SAN, that verifies.
func TestTLSWithoutSNI(t *testing.T) {
	origin := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}})
	host := strings.TrimPrefix(origin.URL, "https://")
	conn, br := connectTunnel(t, w, host)
	defer conn.Close()
	var state tls.ConnectionState
	tc := tls.Client(&bufConn{Conn: conn, r: br}, &tls.Config{
		InsecureSkipVerify: true, // no SNI: verify by hand below
		VerifyConnection: func(cs tls.ConnectionState) error {
			state = cs
			return nil
		},
	})
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	leaf := state.PeerCertificates[0]
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: w.caPool, DNSName: "127.0.0.1"}); err != nil {
		t.Fatalf("leaf for a no-SNI client does not verify for the CONNECT host: %v (IPs %v)", err, leaf.IPAddresses)
	}
}

type bufConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// TestConflictingFramingIsReframed: Transfer-Encoding wins over
// Content-Length (RFC 9112 §6.3) and the request is re-framed upstream, so
// the origin can never read a second, smuggled request out of the body.
func TestConflictingFramingIsReframed(t *testing.T) {
	var seen atomic.Value
	origin := plainOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		seen.Store(fmt.Sprintf("%s %s body=%q", r.Method, r.URL.Path, b))
	}))
	w := newWorld(t, worldOpts{})
	raw := "POST " + origin.URL + "/a HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" +
		"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
	resp, _ := rawExchange(t, w.proxyURL.Host, raw)
	if resp.StatusCode != 200 || seen.Load() != `POST /a body=""` {
		t.Fatalf("origin saw %v (status %d)", seen.Load(), resp.StatusCode)
	}
}

// TestHTTP2RapidReset: a client that opens and resets HTTP/2 streams as
// fast as it can through the MITM, each for a new URL, cannot pile up work:
// x/net/http2 bounds the running stream handlers, dedup.max_flights and
// max_flights_per_client bound the fetches that outlive their clients,
// memory stays bounded, and other clients are served meanwhile.
func TestHTTP2RapidReset(t *testing.T) {
	var originHits atomic.Int64
	origin := tlsOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		originHits.Add(1)
		time.Sleep(50 * time.Millisecond)
		io.WriteString(w, "slow page")
	}), false)
	w := newWorld(t, worldOpts{
		originCAs: []*x509.Certificate{origin.Certificate()},
		dedup:     dedupOn(dedup.Config{MaxFlights: 64}),
		quiet:     true,
	})
	host := strings.TrimPrefix(origin.URL, "https://")
	conn, br := connectTunnel(t, w, host)
	defer conn.Close()
	tc := tls.Client(&bufConn{Conn: conn, r: br}, &tls.Config{ServerName: "127.0.0.1", RootCAs: w.caPool, NextProtos: []string{"h2"}})
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	if tc.ConnectionState().NegotiatedProtocol != "h2" {
		t.Fatal("no h2 through the MITM")
	}
	io.WriteString(tc, http2.ClientPreface)
	fr := http2.NewFramer(tc, tc)
	fr.WriteSettings()
	go func() { // drain the server's frames
		for {
			if _, err := fr.ReadFrame(); err != nil {
				return
			}
		}
	}()

	baseline := runtime.NumGoroutine()
	var peak atomic.Int64
	stopSampling := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			if n := int64(runtime.NumGoroutine()); n > peak.Load() {
				peak.Store(n)
			}
			select {
			case <-stopSampling:
				return
			case <-time.After(2 * time.Millisecond):
			}
		}
	}()
	other := make(chan string, 1)
	go func() {
		time.Sleep(200 * time.Millisecond) // in the middle of the flood
		// Another client is another source address (the flooder has
		// used up its own share of dedup.max_flights, not everyone's).
		c := w.client(true)
		c.Transport.(*http.Transport).DialContext = (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}).DialContext
		resp, body := w.get(c, origin.URL+"/other")
		other <- fmt.Sprintf("%d %s", resp.StatusCode, body)
	}()

	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	const streams = 20000
	sent := 0
	for id := uint32(1); sent < streams; id += 2 {
		hb.Reset()
		for _, kv := range [][2]string{{":method", "GET"}, {":scheme", "https"}, {":authority", host}, {":path", fmt.Sprintf("/r%d", id)}} {
			enc.WriteField(hpack.HeaderField{Name: kv[0], Value: kv[1]})
		}
		if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: hb.Bytes(), EndStream: true, EndHeaders: true}); err != nil {
			break // the server hung up on us: fine too
		}
		if err := fr.WriteRSTStream(id, http2.ErrCodeCancel); err != nil {
			break
		}
		sent++
	}
	if got := <-other; got != "200 slow page" {
		t.Fatalf("another client during the flood: %s", got)
	}
	close(stopSampling)
	<-sampled
	growth := peak.Load() - int64(baseline)
	t.Logf("%d streams opened and reset; goroutines grew by at most %d; the origin saw %d requests", sent, growth, originHits.Load())
	if growth > 3000 {
		t.Fatalf("goroutines grew by %d during a rapid-reset flood: work is not bounded", growth)
	}
	if originHits.Load() >= int64(sent) {
		t.Fatalf("every reset stream became an upstream request (%d)", originHits.Load())
	}
}

// insideTunnel opens a CONNECT to host and returns the stream the client
// speaks HTTP over inside it: TLS with the proxy's CA, or the bare tunnel.
func insideTunnel(t *testing.T, w *world, host string, useTLS bool) net.Conn {
	t.Helper()
	conn, br := connectTunnel(t, w, host)
	t.Cleanup(func() { conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(15 * time.Second))
	var c net.Conn = &bufConn{Conn: conn, r: br}
	if useTLS {
		name, _, _ := net.SplitHostPort(host)
		tc := tls.Client(c, &tls.Config{RootCAs: w.caPool, ServerName: name, NextProtos: []string{"http/1.1"}})
		if err := tc.Handshake(); err != nil {
			t.Fatalf("TLS inside the tunnel: %v", err)
		}
		c = tc
	}
	return c
}

// TestHostileRequestsInsideTunnel: inside an intercepted tunnel, TLS or
// plain, an oversized head gets a 431 and garbage a 400 with a reason, as on
// the proxy port; the connection is not silently dropped, and nothing
// reaches the origin.
func TestHostileRequestsInsideTunnel(t *testing.T) {
	var hits atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits.Add(1) })
	tlsO := tlsOrigin(t, h, true)
	plainO := plainOrigin(t, h)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{tlsO.Certificate()}})
	for _, o := range []struct {
		name string
		host string
		tls  bool
	}{
		{"tls", strings.TrimPrefix(tlsO.URL, "https://"), true},
		{"plain", strings.TrimPrefix(plainO.URL, "http://"), false},
	} {
		for _, tc := range []struct {
			name string
			raw  string
			want int
		}{
			{"many headers", "GET / HTTP/1.1\r\nHost: " + o.host + "\r\n" +
				strings.Repeat("X-Many: 0123456789012345678901234567890123456789\r\n", 2000) + "\r\n", http.StatusRequestHeaderFieldsTooLarge},
			{"one endless line", "GET / HTTP/1.1\r\nHost: " + o.host + "\r\nX-Long: " + strings.Repeat("a", 1<<20) + "\r\n\r\n", http.StatusRequestHeaderFieldsTooLarge},
			{"garbage", "THIS IS NOT HTTP\r\n\r\n", http.StatusBadRequest},
			{"bad header", "GET / HTTP/1.1\r\nHost: " + o.host + "\r\nNo colon here\r\n\r\n", http.StatusBadRequest},
		} {
			t.Run(o.name+"/"+tc.name, func(t *testing.T) {
				c := insideTunnel(t, w, o.host, o.tls)
				go io.WriteString(c, tc.raw) // the server may answer before reading it all
				resp, err := http.ReadResponse(bufio.NewReader(c), nil)
				if err != nil {
					t.Fatalf("no response inside the tunnel: %v", err)
				}
				b, _ := io.ReadAll(resp.Body)
				if resp.StatusCode != tc.want || len(b) == 0 {
					t.Fatalf("status %d body %q, want %d with a reason", resp.StatusCode, b, tc.want)
				}
			})
		}
	}
	if hits.Load() != 0 {
		t.Errorf("the origin saw %d hostile requests", hits.Load())
	}
	if resp, _ := w.get(w.client(false), tlsO.URL+"/fine"); resp.StatusCode != 200 {
		t.Fatal("proxy stopped serving")
	}
}

// TestSlowlorisInsideTunnel: the header timeout holds inside a tunnel too.
func TestSlowlorisInsideTunnel(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{proxy: proxy.Config{ReadHeaderTimeout: 300 * time.Millisecond}})
	c := insideTunnel(t, w, strings.TrimPrefix(origin.URL, "http://"), false)
	fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: x\r\n")
	start := time.Now()
	for time.Since(start) < 10*time.Second {
		if _, err := c.Write([]byte("X")); err != nil {
			return // cut
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatal("a client dribbling its headers inside a tunnel was never cut")
}

// TestBytesSentWithTheConnect: a client that sends its first request in the
// same write as the CONNECT (no wait for the 200) loses nothing.
func TestBytesSentWithTheConnect(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{})
	host := strings.TrimPrefix(origin.URL, "http://")
	conn, err := net.Dial("tcp", w.proxyURL.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\nGET /early HTTP/1.1\r\nHost: %s\r\n\r\n", host, host, host)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %v %v", resp, err)
	}
	resp, err = http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("the request sent with the CONNECT got no answer: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || string(b) != "proto=HTTP/1.1 path=/early" {
		t.Fatalf("status %d body %q", resp.StatusCode, b)
	}
}

// TestH2CInsideTunnel: HTTP/2 with prior knowledge inside a plain tunnel.
func TestH2CInsideTunnel(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(echoProto))
	w := newWorld(t, worldOpts{})
	host := strings.TrimPrefix(origin.URL, "http://")
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true) // prior knowledge, no upgrade dance
	tr := &http.Transport{
		Protocols: &protocols,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return insideTunnel(t, w, host, false), nil
		},
	}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Get("http://" + host + "/h2c")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.ProtoMajor != 2 || !strings.HasSuffix(string(b), "path=/h2c") {
		t.Fatalf("%s %d %q", resp.Proto, resp.StatusCode, b)
	}
}

// TestUntrustedCAIsExplained: a client that does not trust the CA fails
// its handshake, and the log tells the operator what to do about it.
func TestUntrustedCAIsExplained(t *testing.T) {
	origin := tlsOrigin(t, http.HandlerFunc(echoProto), false)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{origin.Certificate()}})
	host := strings.TrimPrefix(origin.URL, "https://")
	conn, br := connectTunnel(t, w, host)
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	tc := tls.Client(&bufConn{Conn: conn, r: br}, &tls.Config{ServerName: "127.0.0.1"}) // system roots only
	if err := tc.Handshake(); err == nil {
		t.Fatal("a client without the CA accepted the interception certificate")
	}
	testkit.Eventually(t, testkit.Patience, func() bool {
		return strings.Contains(w.logs.String(), "does not trust onceproxy's CA")
	}, "the hint in the log")
}

// TestMalformedChunkedBodyIs400: a client whose chunked body is malformed
// gets a 400 that says so, on the proxy port and inside a tunnel, with
// dedup on or off, whether the body is read for the key (GET) or streamed
// upstream (POST); it used to be a 502 "upstream_error".
func TestMalformedChunkedBodyIs400(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		io.WriteString(w, "ok")
	}))
	host := strings.TrimPrefix(origin.URL, "http://")
	for _, dd := range []*dedup.Config{nil, dedupOn(dedup.Config{})} {
		w := newWorld(t, worldOpts{dedup: dd})
		for _, method := range []string{"GET", "POST"} {
			for _, bad := range []string{"zz\r\nabc\r\n0\r\n\r\n", "5\r\nabc\r\n0\r\n\r\n"} {
				head := method + " %s HTTP/1.1\r\nHost: " + host + "\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
				resp, body := rawExchange(t, w.proxyURL.Host, fmt.Sprintf(head, origin.URL+"/a")+bad)
				if resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, "malformed request body") {
					t.Errorf("dedup %v, %s on the proxy port: %d %q", dd != nil, method, resp.StatusCode, body)
				}
				c := insideTunnel(t, w, host, false)
				io.WriteString(c, fmt.Sprintf(head, "/a")+bad)
				resp, err := http.ReadResponse(bufio.NewReader(c), nil)
				if err != nil {
					t.Fatalf("inside a tunnel: %v", err)
				}
				b, _ := io.ReadAll(resp.Body)
				if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), "malformed request body") {
					t.Errorf("dedup %v, %s inside a tunnel: %d %q", dd != nil, method, resp.StatusCode, b)
				}
			}
		}
	}
}

// silentConnects opens n connections to the proxy port, from source
// addresses src(i), each sending a CONNECT and then nothing, and returns
// them with whether the proxy accepted the CONNECT (200) or refused it.
func silentConnects(t *testing.T, w *world, n int, target string, src func(i int) string) (conns []net.Conn, accepted int) {
	t.Helper()
	type res struct {
		c  net.Conn
		ok bool
	}
	out := make(chan res, n)
	sem := make(chan struct{}, 64)
	for i := range n {
		sem <- struct{}{}
		go func() {
			defer func() { <-sem }()
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src(i))}, Timeout: 30 * time.Second}
			c, err := d.Dial("tcp", w.proxyURL.Host)
			if err != nil {
				out <- res{}
				return
			}
			_ = c.SetDeadline(time.Now().Add(30 * time.Second))
			fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", target, target)
			resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: http.MethodConnect})
			_ = c.SetDeadline(time.Time{})
			out <- res{c, err == nil && resp.StatusCode == 200}
		}()
	}
	for range n {
		r := <-out
		if r.c != nil {
			conns = append(conns, r.c)
			t.Cleanup(func() { r.c.Close() })
		}
		if r.ok {
			accepted++
		}
	}
	return conns, accepted
}

// TestSilentTunnelsCannotLockTheDoor: a connection that sends CONNECT and
// then nothing used to hold its slot for the whole idle timeout: 4,200 of
// them locked every new client out. Now one client holds at most its share
// (proxy.max_conns_per_client), its silent tunnels are closed after
// read_header_timeout, near the cap the idlest connections are shed to
// make room, and another client is served all along.
func TestSilentTunnelsCannotLockTheDoor(t *testing.T) {
	origin := plainOrigin(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "page") }))
	target := strings.TrimPrefix(origin.URL, "http://")
	served := func(t *testing.T, w *world, n int) {
		t.Helper()
		c := w.client(false)
		tr := c.Transport.(*http.Transport)
		tr.DisableKeepAlives = true // a new connection each time, as curl makes
		tr.DialContext = (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}).DialContext
		c.Timeout = 10 * time.Second
		var slowest time.Duration
		for range n {
			start := time.Now()
			if resp, body := w.get(c, origin.URL+"/page"); resp.StatusCode != 200 || body != "page" {
				t.Fatalf("another client during the flood: %d %q", resp.StatusCode, body)
			}
			slowest = max(slowest, time.Since(start))
		}
		t.Logf("another client: %d requests served, the slowest in %s", n, slowest.Round(time.Millisecond))
	}

	t.Run("one client, 4200 silent CONNECTs", func(t *testing.T) {
		// A header timeout longer than the flood: every tunnel stays open
		// while it lasts, and only the per-client share stops them.
		w := newWorld(t, worldOpts{proxy: proxy.Config{ReadHeaderTimeout: time.Minute}, quiet: true})
		conns, accepted := silentConnects(t, w, 4200, target, func(int) string { return "127.0.0.1" })
		// A refused connection counts until its refusal is written and it
		// closes, which the accept loop may not have finished when the
		// flood's last answer arrives.
		st := w.srv.ConnStats()
		testkit.Eventually(t, testkit.Patience, func() bool { st = w.srv.ConnStats(); return st.Live <= 2048 }, "one client to hold at most its share of 2048 once its refused connections closed")
		t.Logf("%d connections, %d CONNECTs accepted; stats %+v (max_conns_per_client: half of max_conns, 2048)", len(conns), accepted, st)
		// Beyond its share, each new connection is refused or, once one of
		// the client's own has sat idle past a second (a slow run), takes
		// that one's place: never more than 2048 at once.
		if st.Live > 2048 || st.Refused+st.Shed < 4200-2048 || int64(accepted) > 2048+st.Shed {
			t.Fatalf("one client holds %d connections (%d refused, %d given up), over its share of 2048", st.Live, st.Refused, st.Shed)
		}
		served(t, w, 20)
	})

	t.Run("silent tunnels are closed by read_header_timeout", func(t *testing.T) {
		const headerTimeout = 2 * time.Second
		w := newWorld(t, worldOpts{proxy: proxy.Config{ReadHeaderTimeout: headerTimeout}, quiet: true})
		conns, accepted := silentConnects(t, w, 200, target, func(int) string { return "127.0.0.1" })
		if accepted != 200 {
			t.Fatalf("%d of 200 CONNECTs accepted", accepted)
		}
		deadline := time.Now().Add(headerTimeout + 20*time.Second)
		open := 0
		for _, c := range conns {
			_ = c.SetReadDeadline(deadline)
			var ne net.Error
			if _, err := c.Read(make([]byte, 1)); errors.As(err, &ne) && ne.Timeout() {
				open++
			}
		}
		if open > 0 {
			t.Fatalf("%d silent tunnels were still open 20 s after read_header_timeout", open)
		}
	})

	t.Run("many clients near the cap", func(t *testing.T) {
		// Long header timeout: only shedding can make room here.
		w := newWorld(t, worldOpts{proxy: proxy.Config{MaxConns: 1000, ReadHeaderTimeout: time.Minute}, quiet: true})
		src := func(i int) string { return fmt.Sprintf("127.0.1.%d", 1+i%100) }
		_, accepted := silentConnects(t, w, 900, target, src)
		time.Sleep(1100 * time.Millisecond) // the first wave is idle now
		_, more := silentConnects(t, w, 200, target, src)
		st := w.srv.ConnStats()
		t.Logf("1100 silent CONNECTs from 100 addresses: %d + %d accepted; stats %+v", accepted, more, st)
		if st.Shed == 0 {
			t.Fatal("no idle connection was shed near the cap")
		}
		served(t, w, 20)
	})
}
