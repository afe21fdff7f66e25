package dedup

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/hostmatch"
	"github.com/seed-a3c387e8/onceproxy/internal/idleconn"
)

// PeerClientConfig is what a PeerClient needs.
type PeerClientConfig struct {
	// Token is sent to every peer as "Authorization: Bearer <token>"; ""
	// sends none (a fleet on loopback without a token).
	Token string
	// Timeout bounds connecting to a peer and waiting for its response
	// headers. Default 5s.
	Timeout time.Duration
	// IdleTimeout cuts a peer connection on which nothing moved for this
	// long, mid-body included: the follower then finishes the body from
	// the origin. It must be shorter than dedup.stall_timeout, or the
	// stall would end the follower's flight first. Default 10s.
	IdleTimeout time.Duration
	// MaxIdleConns bounds the idle connections kept per peer. Default 4.
	MaxIdleConns int
}

// PeerClient is the http.RoundTripper an engine reads other instances'
// bodies with (Options.Peers): plain HTTP/1.1 to the address a lease
// names, never through a proxy, the stored bytes as they are (no
// Accept-Encoding of its own, nothing decoded), with the fleet's token and
// a deadline on every step.
type PeerClient struct {
	token string
	tr    *http.Transport
}

// NewPeerClient returns a client with c's settings; Close releases its
// idle connections.
func NewPeerClient(c PeerClientConfig) *PeerClient {
	if c.Timeout <= 0 {
		c.Timeout = 5 * time.Second
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = 10 * time.Second
	}
	if c.MaxIdleConns <= 0 {
		c.MaxIdleConns = 4
	}
	d := &net.Dialer{Timeout: c.Timeout, KeepAlive: 30 * time.Second}
	tr := &http.Transport{
		Proxy: nil, // a peer is dialled directly, whatever HTTP_PROXY says
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			conn, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return idleconn.Wrap(conn, c.IdleTimeout), nil
		},
		// The body is the stored bytes in the stored coding: a transparent
		// gzip would hand the spool other bytes than the headers describe.
		DisableCompression:     true,
		ResponseHeaderTimeout:  c.Timeout,
		MaxIdleConnsPerHost:    c.MaxIdleConns,
		IdleConnTimeout:        90 * time.Second,
		MaxResponseHeaderBytes: 1 << 20,
	}
	return &PeerClient{token: c.Token, tr: tr}
}

// RoundTrip implements http.RoundTripper.
func (c *PeerClient) RoundTrip(req *http.Request) (*http.Response, error) {
	if c.token != "" {
		req = req.Clone(req.Context())
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	return c.tr.RoundTrip(req)
}

// Close closes the idle connections; fetches still running go on.
func (c *PeerClient) Close() { c.tr.CloseIdleConnections() }

// ValidPeerAddr reports whether addr, read from a shared store, can name a
// peer listener: host:port with a host (an IP address without a zone, or a
// DNS name) and a port from 1 to 65535. A store is trusted to name peers
// (it names the values clients get, too), but what it holds must not make
// the engine dial nonsense: addr is the authority of the URL a follower
// requests, and a host holding '/', '?', '#' or '@' would end it early and
// send the request, the fleet's token with it, to another port.
func ValidPeerAddr(addr string) bool {
	if len(addr) > 300 {
		return false
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil || host == "" || !allDigits(port) {
		return false
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
		return false
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		return ip.Zone() == ""
	}
	// Brackets hold an IP address; a name is a DNS name (the one rule).
	return !strings.Contains(addr, "[") && hostmatch.ValidName(host)
}

func allDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return s != ""
}

// errPeer marks a peer that could not serve a body; the follower fetches
// it from the origin itself.
var errPeer = errors.New("peer did not serve the body")
