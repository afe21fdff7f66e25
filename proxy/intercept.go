package proxy

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/elazarl/goproxy"

	"github.com/seed-a3c387e8/onceproxy/internal/halfclose"
	"github.com/seed-a3c387e8/onceproxy/internal/readahead"
)

// The requests inside an intercepted CONNECT tunnel are read by an
// http.Server of our own, not by goproxy's MITM loop, which parses them with
// http.ReadRequest: no cap on a header line (one authenticated client could
// make the process buffer a gigabyte of "header"), no header timeout, and a
// malformed request closed the connection without an answer. net/http
// enforces max_header_bytes and read_header_timeout here as on the proxy
// port, answers 400 or 431 with a reason, negotiates HTTP/2 (ALPN, and h2c
// inside a plain tunnel), bounds HTTP/2 streams, and drains on Shutdown.
// Each decrypted request then takes goproxy's request path (handle, the
// response copy, WebSocket splicing) exactly like a plain proxy request, so
// the two paths cannot drift apart.

// recordTypeHandshake starts every TLS stream (a ClientHello record).
const recordTypeHandshake = 0x16

// tunnel is what the CONNECT that opened a tunnel tells its requests.
type tunnel struct {
	client     *clientInfo
	host       string // the CONNECT target, host:port
	remoteAddr string // the client's address, as on the CONNECT (or SOCKS5 connection)
	scheme     string // "https" when the client spoke TLS, else "http"
}

type tunnelKey struct{}

// tunnelFrom returns the tunnel a request arrived through, or nil.
func tunnelFrom(ctx context.Context) *tunnel {
	t, _ := ctx.Value(tunnelKey{}).(*tunnel)
	return t
}

// interceptedConn is a client connection handed to the inner server, with
// the tunnel it belongs to (ConnContext puts it in every request's
// context).
type interceptedConn struct {
	halfclose.Conn
	t *tunnel
}

// newInner builds the server for intercepted tunnels. It shares the proxy
// port's limits.
func (s *Server) newInner() *http.Server {
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetHTTP2(true)
	protocols.SetUnencryptedHTTP2(true) // h2c with prior knowledge in a plain tunnel
	return &http.Server{
		Handler:           http.HandlerFunc(s.serveIntercepted),
		ReadHeaderTimeout: s.cfg.ReadHeaderTimeout,
		IdleTimeout:       s.cfg.IdleTimeout,
		MaxHeaderBytes:    s.cfg.MaxHeaderBytes,
		Protocols:         &protocols,
		ErrorLog:          log.New(innerLog{s.logger}, "", 0),
		ConnState:         markBusy,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			if tc, ok := c.(*tls.Conn); ok {
				c = tc.NetConn()
			}
			if ic, ok := c.(*interceptedConn); ok {
				ctx = context.WithValue(ctx, tunnelKey{}, ic.t)
			}
			return ctx
		},
	}
}

// innerLog sorts what the inner http.Server reports. A client that rejects
// the interception certificate is the one thing an operator must act on
// (install the CA), so it says so; a tunnel closed before or during the
// handshake (browsers open spare ones) is routine.
type innerLog struct{ l *slog.Logger }

func (w innerLog) Write(p []byte) (int, error) {
	msg := strings.TrimSpace(string(p))
	switch {
	case strings.Contains(msg, "TLS handshake error") &&
		(strings.Contains(msg, "bad certificate") || strings.Contains(msg, "unknown certificate")):
		w.l.Warn("a client rejected the interception certificate: it does not trust onceproxy's CA yet (see README: Clients)",
			"detail", msg)
	case strings.Contains(msg, "TLS handshake error"):
		w.l.Debug("intercepted tunnel: " + msg)
	default:
		w.l.Warn("intercepted tunnel: " + msg)
	}
	return len(p), nil
}

// startInner serves the inner server on first use, unless Shutdown came
// first. Shutdown stops it.
func (s *Server) startInner() {
	s.innerMu.Lock()
	defer s.innerMu.Unlock()
	if s.innerStarted || s.innerClosed {
		return
	}
	s.innerStarted = true
	s.innerWG.Add(1)
	go func() {
		defer s.innerWG.Done()
		if err := s.inner.Serve(s.innerLn); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.logger.Error("serving intercepted tunnels stopped", "err", err)
		}
	}()
}

// shutdownInner stops taking tunnels, closes idle ones and waits, until
// ctx ends, for the requests being read or answered inside them.
func (s *Server) shutdownInner(ctx context.Context) error {
	s.innerMu.Lock()
	s.innerClosed = true
	s.innerMu.Unlock()
	s.innerLn.Close() // also when never served: a pending push must fail
	err := s.inner.Shutdown(ctx)
	s.innerWG.Wait()
	return err
}

// hijackConnect is the Hijack of an intercepted CONNECT (goproxy has
// authenticated and checked it in handleConnect): confirm the tunnel, then
// intercept it.
func (s *Server) hijackConnect(req *http.Request, client net.Conn, pctx *goproxy.ProxyCtx) {
	ci, _ := pctx.UserData.(*clientInfo)
	if ci == nil {
		ci = &clientInfo{connect: req.Host}
	}
	proto := req.Proto
	if !strings.HasPrefix(proto, "HTTP/1.") {
		proto = "HTTP/1.1"
	}
	if _, err := io.WriteString(client, proto+" 200 Connection established\r\n\r\n"); err != nil {
		client.Close()
		return
	}
	s.intercept(client, &tunnel{client: ci, host: ci.connect, remoteAddr: req.RemoteAddr})
}

// intercept looks at the first byte of a tunnel's client stream (a CONNECT
// tunnel's, or a SOCKS5 one's) to tell TLS from plain HTTP, and hands the
// connection to the inner server, which closes it when done.
func (s *Server) intercept(client net.Conn, t *tunnel) {
	// A tunnel must start speaking within read_header_timeout, as a request
	// on the proxy port must: a silent one holds a connection slot for
	// nothing, and thousands of them locked every new client out. A
	// browser reopens a spare tunnel cut this way when it needs one.
	_ = client.SetReadDeadline(time.Now().Add(s.cfg.ReadHeaderTimeout))
	var first [1]byte
	if _, err := io.ReadFull(client, first[:]); err != nil {
		client.Close()
		return
	}
	_ = client.SetReadDeadline(time.Time{})
	t.scheme = "http"
	var conn net.Conn = &interceptedConn{Conn: halfclose.Conn{Conn: readahead.New(client, first[:])}, t: t}
	if first[0] == recordTypeHandshake {
		t.scheme = "https"
		cfg := s.certs.ServerConfig(t.host).Clone()
		cfg.NextProtos = []string{"h2", "http/1.1"}
		conn = tls.Server(conn, cfg)
	}
	s.startInner()
	if err := s.innerLn.push(conn); err != nil {
		conn.Close() // shutting down
	}
}

// serveIntercepted completes a decrypted request into the absolute form a
// proxy request has, then runs it through goproxy like one.
func (s *Server) serveIntercepted(w http.ResponseWriter, r *http.Request) {
	t := tunnelFrom(r.Context())
	if t == nil {
		writeResponse(w, errorResponse(r, http.StatusInternalServerError, kindInternal,
			"internal error: a request without its tunnel"))
		return
	}
	if r.Method == http.MethodConnect {
		writeResponse(w, errorResponse(r, http.StatusBadRequest, kindBadRequest,
			"CONNECT inside an intercepted tunnel is not supported"))
		return
	}
	r.URL.Scheme = t.scheme
	if r.URL.Host == "" {
		// Origin-form: the Host header (HTTP/2: :authority) names the
		// origin, as it would for the origin itself; the CONNECT target
		// stands in when the client sent neither.
		r.URL.Host = r.Host
		if r.URL.Host == "" {
			r.URL.Host = t.host
		}
	}
	r.RemoteAddr = t.remoteAddr
	s.gp.ServeHTTP(streamTo(w), r)
}

// writeResponse writes a response built by errorResponse to w.
func writeResponse(w http.ResponseWriter, resp *http.Response) {
	for k, v := range resp.Header {
		w.Header()[k] = v
	}
	w.WriteHeader(resp.StatusCode)
	if resp.Body != nil {
		_, _ = io.Copy(w, resp.Body)
		resp.Body.Close()
	}
}
