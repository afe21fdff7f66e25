// Package upstream is how onceproxy reaches origins: directly, or through an
// upstream proxy (HTTP CONNECT or SOCKS5). It exposes the standard seams: an
// http.RoundTripper for requests and a DialContext for blind tunnels.
//
// The outgoing side never reads the process's own HTTP_PROXY / HTTPS_PROXY
// variables: a proxy that chains through whatever its environment says is a
// proxy whose egress nobody configured.
package upstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"time"

	xproxy "golang.org/x/net/proxy"

	"github.com/seed-a3c387e8/onceproxy/internal/idleconn"
)

// DialError reports that a connection toward the origin could not be
// established: the request never reached the origin, so it is safe to retry
// and the failure says nothing about the origin's answer.
type DialError struct {
	Op  string
	Err error
}

func (e *DialError) Error() string { return e.Op + ": " + e.Err.Error() }
func (e *DialError) Unwrap() error { return e.Err }

// Forwarder sends requests to origins and opens tunnels to them, either
// directly or through the single upstream proxy of the configuration.
type Forwarder struct {
	proxyURL  *url.URL // nil: direct
	dialer    *net.Dialer
	idle      func(net.Conn) net.Conn
	socks     xproxy.ContextDialer // non-nil for a socks5 upstream
	transport *http.Transport
}

// New builds a Forwarder from cfg (defaults applied by the caller or here).
func New(cfg Config, logger *slog.Logger) (*Forwarder, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("upstream: %w", err)
	}
	tlsConf, err := originTLSConfig(cfg, logger)
	if err != nil {
		return nil, fmt.Errorf("upstream: %w", err)
	}
	f := &Forwarder{
		dialer: &net.Dialer{Timeout: cfg.DialTimeout, KeepAlive: 30 * time.Second},
		idle:   func(c net.Conn) net.Conn { return idleconn.Wrap(c, cfg.IdleTimeout) },
	}
	if cfg.URL != "" {
		f.proxyURL, _ = parseProxyURL(cfg.URL) // validated above
		if f.proxyURL.Scheme == "socks5" {
			d, err := xproxy.FromURL(f.proxyURL, f.dialer)
			if err != nil {
				return nil, fmt.Errorf("upstream: socks5 dialer: %w", err)
			}
			cd, ok := d.(xproxy.ContextDialer)
			if !ok {
				return nil, errors.New("upstream: socks5 dialer does not support contexts")
			}
			f.socks = cd
		}
	}
	f.transport = &http.Transport{
		// Proxy is fixed by our configuration; never ProxyFromEnvironment.
		Proxy:                 f.transportProxy,
		DialContext:           f.dialRaw,
		TLSClientConfig:       tlsConf,
		ForceAttemptHTTP2:     true,
		TLSHandshakeTimeout:   cfg.TLSHandshakeTimeout,
		ResponseHeaderTimeout: cfg.ResponseHeaderTimeout,
		ExpectContinueTimeout: time.Second,
		IdleConnTimeout:       cfg.IdleConnTimeout,
		MaxIdleConns:          cfg.MaxIdleConnsPerHost * 64,
		MaxIdleConnsPerHost:   cfg.MaxIdleConnsPerHost,
		// The client's Accept-Encoding goes upstream untouched and the
		// origin's compressed bytes come back untouched: transparent
		// decompression would make us pay for (and cache) the wrong bytes.
		DisableCompression: true,
	}
	if f.proxyURL != nil && f.proxyURL.Scheme == "socks5" {
		// The transport's own SOCKS5 support would dial the upstream with
		// DialContext, i.e. with our idle wrapper: fine, but we want one
		// code path for SOCKS tunnels and requests, so requests dial the
		// origin through f.socks below and the transport sees no proxy.
		f.transport.Proxy = nil
	}
	return f, nil
}

func (f *Forwarder) transportProxy(*http.Request) (*url.URL, error) {
	return f.proxyURL, nil // nil for direct: the transport dials the origin
}

// dialRaw is the transport's DialContext. With an HTTP upstream the transport
// itself asks for the upstream's address and speaks CONNECT / absolute-form
// over the connection; with SOCKS5 we dial the origin through the upstream.
func (f *Forwarder) dialRaw(ctx context.Context, network, addr string) (net.Conn, error) {
	if f.socks != nil {
		c, err := f.socks.DialContext(ctx, network, addr)
		if err != nil {
			return nil, &DialError{Op: "socks5 dial " + addr + " through upstream " + f.proxyURL.Host, Err: err}
		}
		return f.idle(c), nil
	}
	c, err := f.dialer.DialContext(ctx, network, addr)
	if err != nil {
		return nil, &DialError{Op: "dial " + addr, Err: err}
	}
	return f.idle(c), nil
}

// RoundTrip sends req to its origin. It implements http.RoundTripper.
func (f *Forwarder) RoundTrip(req *http.Request) (*http.Response, error) {
	return f.transport.RoundTrip(req)
}

// DialContext opens a byte tunnel to addr ("host:port") for traffic the proxy
// does not interpret (bypass hosts, non-HTTP protocols).
func (f *Forwarder) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	if f.proxyURL != nil && f.proxyURL.Scheme == "http" {
		c, err := connectThrough(ctx, f.dialer, f.proxyURL, addr)
		if err != nil {
			return nil, err
		}
		return f.idle(c), nil
	}
	return f.dialRaw(ctx, network, addr)
}

// Describe names the egress for logs: "direct" or the upstream URL without
// its password.
func (f *Forwarder) Describe() string {
	if f.proxyURL == nil {
		return "direct"
	}
	return f.proxyURL.Redacted()
}

// Close drops pooled idle connections.
func (f *Forwarder) Close() { f.transport.CloseIdleConnections() }
