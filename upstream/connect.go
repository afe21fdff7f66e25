package upstream

import (
	"bufio"
	"context"
	"encoding/base64"
	"io"
	"net"
	"net/http"
	"net/url"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/readahead"
)

// connectThrough opens a tunnel to addr through the HTTP proxy at proxyURL
// with a CONNECT request, authenticating with the URL's userinfo. The whole
// exchange is bounded by ctx and by the dial timeout of d.
func connectThrough(ctx context.Context, d *net.Dialer, proxyURL *url.URL, addr string) (net.Conn, error) {
	conn, err := d.DialContext(ctx, "tcp", proxyURL.Host)
	if err != nil {
		return nil, &DialError{Op: "dial upstream proxy " + proxyURL.Host, Err: err}
	}
	// The CONNECT exchange must not hang on a proxy that accepts and then
	// says nothing: use the context deadline, or the dial timeout.
	deadline, ok := ctx.Deadline()
	if !ok && d.Timeout > 0 {
		deadline = time.Now().Add(d.Timeout)
	}
	_ = conn.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()

	req := &http.Request{
		Method: http.MethodConnect,
		URL:    &url.URL{Opaque: addr},
		Host:   addr,
		Header: make(http.Header),
	}
	if u := proxyURL.User; u != nil {
		pass, _ := u.Password()
		req.Header.Set("Proxy-Authorization", "Basic "+
			base64.StdEncoding.EncodeToString([]byte(u.Username()+":"+pass)))
	}
	if err := req.Write(conn); err != nil {
		conn.Close()
		return nil, &DialError{Op: "write CONNECT to upstream proxy", Err: err}
	}
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, req)
	if err != nil {
		conn.Close()
		return nil, &DialError{Op: "read CONNECT response from upstream proxy", Err: err}
	}
	if resp.StatusCode != http.StatusOK {
		// A short body often says why (bad credentials, host refused).
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 256))
		resp.Body.Close()
		conn.Close()
		return nil, &DialError{
			Op:  "CONNECT " + addr + " through upstream proxy " + proxyURL.Host,
			Err: &gatewayStatusError{StatusCode: resp.StatusCode, Status: resp.Status, Detail: trimLine(msg)},
		}
	}
	if !stop() {
		// ctx ended while we finished the handshake: the deadline was
		// already pulled in, so the tunnel is unusable.
		conn.Close()
		return nil, &DialError{Op: "CONNECT " + addr, Err: ctx.Err()}
	}
	_ = conn.SetDeadline(time.Time{})
	// The proxy may already have relayed the first bytes of the origin.
	return readahead.Buffered(conn, br), nil
}

func trimLine(b []byte) string {
	for i, c := range b {
		if c == '\r' || c == '\n' {
			return string(b[:i])
		}
	}
	return string(b)
}
