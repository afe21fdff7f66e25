package upstream

import (
	"bufio"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
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
	// says nothing: the dial timeout bounds it, or the context's deadline
	// when that comes first. Not the context's alone: a gateway that eats
	// a caller's whole budget (a blind tunnel's 15 s) fails with the
	// caller's deadline, which says nothing about the session, and no
	// other session is tried.
	deadline, ok := ctx.Deadline()
	if d.Timeout > 0 {
		if own := time.Now().Add(d.Timeout); !ok || own.Before(deadline) {
			deadline = own
		}
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
	// The reply head is read through a limit, as net/http bounds a
	// response's header (MaxResponseHeaderBytes): a gateway that sends an
	// endless header must not make us buffer it. The limit is lifted once
	// the head is read, for the short body of a refusal.
	lr := &io.LimitedReader{R: conn, N: maxConnectReplyBytes}
	br := bufio.NewReader(lr)
	resp, err := http.ReadResponse(br, req)
	if err != nil {
		conn.Close()
		if lr.N <= 0 {
			err = fmt.Errorf("reply head exceeds %d bytes: %w", maxConnectReplyBytes, errConnectReplyTooLarge)
		}
		return nil, &DialError{Op: "read CONNECT response from upstream proxy", Err: err}
	}
	lr.N = maxConnectReplyBytes
	// Any 2xx opens the tunnel (RFC 9110 §9.3.6), not only 200.
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		var gerr error = gatewayAnswer(resp)
		conn.Close()
		if st := targetStatusOfConnect(resp.StatusCode); st != 0 {
			// "Bad gateway" to CONNECT is how a gateway says it could
			// not reach addr, "forbidden" that its provider refuses
			// addr: not proof that the session is at fault.
			gerr = &TargetUnreachableError{Target: addr, Status: st, Err: gerr}
		}
		return nil, &DialError{Op: "CONNECT " + addr + " through upstream proxy " + proxyURL.Host, Err: gerr}
	}
	if !stop() {
		// ctx ended while we finished the handshake: the deadline was
		// already pulled in, so the tunnel is unusable.
		conn.Close()
		return nil, &DialError{Op: "CONNECT " + addr, Err: ctx.Err()}
	}
	_ = conn.SetDeadline(time.Time{})
	// The proxy may already have relayed the first bytes of the origin;
	// br (and its limited reader) is dropped: the tunnel reads conn.
	return readahead.Buffered(conn, br), nil
}

// maxConnectReplyBytes bounds the head of a gateway's CONNECT reply: real
// ones are a few hundred bytes; net/http's default cap on a response
// header is 1 MiB, a gateway's handshake needs far less.
const maxConnectReplyBytes = 64 << 10

// errConnectReplyTooLarge is a CONNECT reply head over maxConnectReplyBytes.
var errConnectReplyTooLarge = errors.New("upstream proxy's CONNECT reply too large")

func trimLine(b []byte) string {
	for i, c := range b {
		if c == '\r' || c == '\n' {
			return string(b[:i])
		}
	}
	return string(b)
}
