package app

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"syscall"
)

// listeners are the sockets onceproxy serves on.
type listeners struct {
	proxy, socks, admin net.Listener
	peer                net.Listener // nil: fleet.peer_listen is ""
	// self are the endpoints of our own listeners: the proxy must never
	// connect to itself (a request looping back, or reaching the admin API
	// through the proxy port).
	self []netip.AddrPort
	// selfPorts are the ports of listeners bound to every address.
	selfPorts map[uint16]bool
}

func listen(cfg *Config) (*listeners, error) {
	l := &listeners{selfPorts: map[uint16]bool{}}
	var err error
	if l.proxy, err = net.Listen("tcp", cfg.Proxy.Listen); err != nil {
		return nil, fmt.Errorf("proxy.listen: %w", err)
	}
	if cfg.SOCKS5.Listen != "" {
		if l.socks, err = net.Listen("tcp", cfg.SOCKS5.Listen); err != nil {
			l.close()
			return nil, fmt.Errorf("socks5.listen: %w", err)
		}
	}
	if cfg.Admin.Listen != "" {
		if l.admin, err = net.Listen("tcp", cfg.Admin.Listen); err != nil {
			l.close()
			return nil, fmt.Errorf("admin.listen: %w", err)
		}
	}
	if cfg.Fleet.PeerListen != "" {
		if l.peer, err = net.Listen("tcp", cfg.Fleet.PeerListen); err != nil {
			l.close()
			return nil, fmt.Errorf("fleet.peer_listen: %w", err)
		}
	}
	for _, ln := range []net.Listener{l.proxy, l.socks, l.admin, l.peer} {
		if ln == nil {
			continue
		}
		ap := ln.Addr().(*net.TCPAddr).AddrPort()
		if ap.Addr().IsUnspecified() {
			l.selfPorts[ap.Port()] = true
		} else {
			l.self = append(l.self, netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()))
		}
	}
	return l, nil
}

func (l *listeners) close() {
	for _, ln := range []net.Listener{l.proxy, l.socks, l.admin, l.peer} {
		if ln != nil {
			ln.Close()
		}
	}
}

// selfError refuses a connection to one of our own listeners.
type selfError struct{ addr netip.AddrPort }

func (e *selfError) Error() string {
	return "refusing to connect to " + e.addr.String() + ": that is onceproxy's own proxy, SOCKS5, admin or peer port"
}
func (e *selfError) HTTPStatus() int { return http.StatusForbidden }

// isSelf reports whether addr is one of our listeners: an exact listening
// address, or a local address on the port of a listener bound to all
// interfaces.
func (l *listeners) isSelf(ap netip.AddrPort) bool {
	ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	for _, s := range l.self {
		if s == ap || (s.Port() == ap.Port() && s.Addr().IsLoopback() && ap.Addr().IsLoopback()) {
			return true
		}
	}
	if !l.selfPorts[ap.Port()] {
		return false
	}
	if ap.Addr().IsLoopback() || ap.Addr().IsUnspecified() {
		return true
	}
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if p, err := netip.ParsePrefix(a.String()); err == nil && p.Addr().Unmap() == ap.Addr() {
			return true
		}
	}
	return false
}

// guardControl is the dial-time check of every direct origin connection:
// never our own ports, then the SSRF guard on the resolved address.
func (l *listeners) guardControl(g interface {
	Control(ctx context.Context, network, address string, c syscall.RawConn) error
}) func(ctx context.Context, network, address string, c syscall.RawConn) error {
	return func(ctx context.Context, network, address string, c syscall.RawConn) error {
		if ap, err := netip.ParseAddrPort(address); err == nil && l.isSelf(ap) {
			return &selfError{ap}
		}
		return g.Control(ctx, network, address, c)
	}
}
