package fakeprovider

import (
	"bufio"
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	socks5 "github.com/things-go/go-socks5"
	"github.com/things-go/go-socks5/statute"
)

// gatewayConn is the state of one client connection to the HTTP gateway.
// The server calls a connection's handlers one after the other, on one
// goroutine, so seen needs no lock.
type gatewayConn struct {
	seen map[string]bool // sessions already counted for this connection
}

type gatewayConnKey struct{}

func withGatewayConn(ctx context.Context, _ net.Conn) context.Context {
	return context.WithValue(ctx, gatewayConnKey{}, &gatewayConn{seen: map[string]bool{}})
}

// serveGateway is the HTTP gateway: CONNECT tunnels and absolute-form
// requests, authenticated per session with Proxy-Authorization: Basic.
func (p *Provider) serveGateway(w http.ResponseWriter, r *http.Request) {
	var s *session
	if user, pass, ok := proxyBasicAuth(r.Header.Get("Proxy-Authorization")); ok {
		s = p.userSession(user, pass)
	}
	if s == nil {
		w.Header().Set("Proxy-Authenticate", `Basic realm="fakeprovider"`)
		http.Error(w, "fakeprovider: bad session credentials", http.StatusProxyAuthRequired)
		return
	}
	if gc, _ := r.Context().Value(gatewayConnKey{}).(*gatewayConn); gc != nil && !gc.seen[s.ID] {
		gc.seen[s.ID] = true
		p.mu.Lock()
		s.conns++
		p.mu.Unlock()
	}
	mode, unhang := p.modeOf(s)
	switch mode {
	case ModeRefuse:
		// Drop the connection without a word.
		panic(http.ErrAbortHandler)
	case Mode429:
		// Its own answer, as RFC 9209 has a gateway say: a client can
		// tell it from an origin's 429 to an absolute-form request.
		w.Header().Set("Proxy-Status", "fakeprovider; error=http_request_denied")
		http.Error(w, "fakeprovider: session rate limited", http.StatusTooManyRequests)
		return
	case Mode502:
		http.Error(w, "fakeprovider: upstream failure", http.StatusBadGateway)
		return
	case ModeHang:
		select {
		case <-unhang:
		case <-p.closing:
			return
		case <-r.Context().Done():
			return
		}
	}
	target := r.URL.Host
	if r.Method == http.MethodConnect {
		target = r.Host
	}
	if p.isBlocked(target) {
		// Its own refusal, said so (RFC 9209) on an absolute-form answer.
		w.Header().Set("Proxy-Status", "fakeprovider; error=destination_ip_prohibited")
		http.Error(w, "fakeprovider: target blocked by policy", http.StatusForbidden)
		return
	}
	if r.Method == http.MethodConnect {
		p.connect(w, r, s)
		return
	}
	p.forward(w, r, s)
}

func (p *Provider) connect(w http.ResponseWriter, r *http.Request, s *session) {
	ip := p.exitFor(s)
	target, err := p.dialFrom(ip, r.Host)
	if err != nil {
		http.Error(w, "fakeprovider: "+err.Error(), http.StatusBadGateway)
		return
	}
	tc := p.trackTunnel(s, target)
	w.WriteHeader(http.StatusOK)
	client, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		tc.Close()
		return
	}
	// The server stops waiting for a connection once it is hijacked, so
	// Close may already be waiting on the WaitGroup: Add only while the
	// provider is open, under the lock Close takes to mark it closed.
	p.mu.Lock()
	select {
	case <-p.closing:
		p.mu.Unlock()
		client.Close()
		tc.Close()
		return
	default:
	}
	p.wg.Add(1)
	p.mu.Unlock()
	go func() {
		defer p.wg.Done()
		pump(client, brw.Reader, tc)
	}()
}

// pump copies both ways until either side ends, then closes both.
func pump(client net.Conn, fromClient *bufio.Reader, target net.Conn) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = io.Copy(target, fromClient)
		if cw, ok := target.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		}
	}()
	_, _ = io.Copy(client, target)
	client.Close()
	<-done
	target.Close()
}

// forward relays one absolute-form request from the session's exit IP, on
// a connection of its own.
func (p *Provider) forward(w http.ResponseWriter, r *http.Request, s *session) {
	if r.URL.Scheme != "http" || r.URL.Host == "" {
		http.Error(w, "fakeprovider: not a proxy request", http.StatusBadRequest)
		return
	}
	ip := p.exitFor(s)
	// The transport's one dial (no keep-alives) failed. It is written by
	// the transport's dialing goroutine, which outlives a RoundTrip its
	// request's context ended: atomic, not a plain bool.
	var dialFailed atomic.Bool
	out := r.Clone(r.Context())
	out.RequestURI = ""
	out.Header.Del("Proxy-Authorization")
	out.Header.Del("Proxy-Connection")
	tr := &http.Transport{
		Proxy: nil,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: ip.AsSlice()}, Timeout: 5 * time.Second}
			c, err := d.DialContext(ctx, network, addr)
			dialFailed.Store(err != nil)
			return c, err
		},
		DisableKeepAlives:  true,
		DisableCompression: true,
	}
	defer tr.CloseIdleConnections()
	resp, err := tr.RoundTrip(out)
	if err != nil {
		if dialFailed.Load() {
			// As gateways say it (RFC 9209): the target was never reached.
			w.Header().Set("Proxy-Status", "fakeprovider; error=destination_unavailable")
		}
		http.Error(w, "fakeprovider: "+err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	for k, v := range resp.Header {
		w.Header()[k] = v
	}
	w.WriteHeader(resp.StatusCode)
	_, _ = io.Copy(w, resp.Body)
}

func proxyBasicAuth(v string) (user, pass string, ok bool) {
	scheme, cred, found := strings.Cut(v, " ")
	if !found || !strings.EqualFold(scheme, "Basic") {
		return "", "", false
	}
	raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(cred))
	if err != nil {
		return "", "", false
	}
	return strings.Cut(string(raw), ":")
}

// apiHandler serves the session API.
func (p *Provider) apiHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /api/session", func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		list := struct {
			Sessions []Wire `json:"sessions"`
		}{Sessions: []Wire{}}
		if p.apiMode != APIEmpty {
			for _, id := range p.order {
				list.Sessions = append(list.Sessions, p.wire(p.sessions[id]))
			}
		}
		p.mu.Unlock()
		writeJSON(w, http.StatusOK, list)
	})
	mux.HandleFunc("POST /api/session/{id}/rotate", func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		s := p.sessions[r.PathValue("id")]
		var ws Wire
		if s != nil {
			p.rotateLocked(s)
			ws = p.wire(s)
		}
		p.mu.Unlock()
		if s == nil {
			writeJSON(w, http.StatusNotFound, map[string]string{"error": "unknown session"})
			return
		}
		writeJSON(w, http.StatusOK, ws)
	})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		p.apiCalls++
		mode, unhang := p.apiMode, p.apiUnh
		p.mu.Unlock()
		if r.Header.Get("Authorization") != "Bearer "+p.opts.APIKey {
			writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "bad or missing bearer token"})
			return
		}
		switch mode {
		case APIGarbage:
			w.Header().Set("Content-Type", "text/html")
			_, _ = io.WriteString(w, "<html><body>Service temporarily overloaded</body></html>")
			return
		case API500:
			writeJSON(w, http.StatusInternalServerError, map[string]string{"error": "internal error"})
			return
		case API429:
			w.Header().Set("Retry-After", strconv.Itoa(cmp.Or(p.opts.APIRetryAfter, 30)))
			writeJSON(w, http.StatusTooManyRequests, map[string]string{"error": "rate limited"})
			return
		case APIHang:
			select {
			case <-unhang:
			case <-p.closing:
				return
			case <-r.Context().Done():
				return
			}
		}
		mux.ServeHTTP(w, r)
	})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// startSOCKS5 serves the SOCKS5 gateway: RFC 1929 credentials per session,
// CONNECT only.
func (p *Provider) startSOCKS5() {
	srv := socks5.NewServer(
		socks5.WithCredential(credentials{p}),
		socks5.WithRule(policy{p}),
		socks5.WithResolver(keepName{}),
		socks5.WithDialAndRequest(p.socksDial),
		socks5.WithGPool(trackedPool{p}),
	)
	ln := &trackingListener{Listener: p.socksLn, p: p}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		_ = srv.Serve(ln)
	}()
}

func (p *Provider) socksDial(_ context.Context, _, addr string, req *socks5.Request) (net.Conn, error) {
	var user, pass string
	if req.AuthContext != nil {
		user, pass = req.AuthContext.Payload["username"], req.AuthContext.Payload["password"]
	}
	s := p.userSession(user, pass)
	if s == nil {
		return nil, errors.New("fakeprovider: bad session credentials")
	}
	p.mu.Lock()
	s.conns++
	p.mu.Unlock()
	mode, unhang := p.modeOf(s)
	switch mode {
	case ModeRefuse:
		// go-socks5 answers "connection refused" for this message.
		return nil, errors.New("fakeprovider: connection refused")
	case Mode429:
		return nil, errors.New("fakeprovider: session rate limited")
	case Mode502:
		return nil, errors.New("fakeprovider: upstream failure")
	case ModeHang:
		select {
		case <-unhang:
		case <-p.closing:
			return nil, errors.New("fakeprovider: closing")
		}
	}
	c, err := p.dialFrom(p.exitFor(s), addr)
	if err != nil {
		return nil, err
	}
	return p.trackTunnel(s, c), nil
}

// policy permits CONNECT to targets that are not blocked (Block).
type policy struct{ p *Provider }

func (r policy) Allow(ctx context.Context, req *socks5.Request) (context.Context, bool) {
	return ctx, req.Command == statute.CommandConnect && !r.p.isBlocked(req.RawDestAddr.String())
}

type credentials struct{ p *Provider }

func (c credentials) Valid(user, pass, _ string) bool { return c.p.userSession(user, pass) != nil }

// keepName leaves host names unresolved: the target is dialed by name, as
// a real gateway resolves on its side.
type keepName struct{}

func (keepName) Resolve(ctx context.Context, _ string) (context.Context, net.IP, error) {
	return ctx, nil, nil
}

// trackedPool runs go-socks5's goroutines under the provider's WaitGroup.
// Submit is only called from goroutines the WaitGroup already counts (the
// accept loop, a connection), so Add never races Close's Wait.
type trackedPool struct{ p *Provider }

func (t trackedPool) Submit(f func()) error {
	t.p.wg.Add(1)
	go func() {
		defer t.p.wg.Done()
		f()
	}()
	return nil
}

// trackingListener remembers SOCKS5 client connections so Close can cut
// them (go-socks5 only stops accepting).
type trackingListener struct {
	net.Listener
	p *Provider
}

func (l *trackingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	tc := &trackedConn{Conn: c}
	tc.onClose = func() {
		l.p.mu.Lock()
		delete(l.p.socksConns, tc)
		l.p.mu.Unlock()
	}
	l.p.mu.Lock()
	select {
	case <-l.p.closing:
		l.p.mu.Unlock()
		c.Close()
		return nil, net.ErrClosed
	default:
	}
	l.p.socksConns[tc] = struct{}{}
	l.p.mu.Unlock()
	return tc, nil
}
