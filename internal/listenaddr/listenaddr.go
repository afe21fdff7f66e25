// Package listenaddr checks a listen address the way net.Listen will take
// it, so that a configuration with one that cannot be bound fails its
// check (onceproxy -check, a reload) instead of the start that follows,
// and tells the addresses of this machine alone (Loopback) from others.
package listenaddr

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
)

// Check reports whether addr is host:port with a numeric port from 0 (any
// free port) to 65535. net.SplitHostPort alone takes "localhost:abc" and
// ":99999", which net.Listen then refuses.
func Check(addr string) error {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%q is not host:port: %w", addr, err)
	}
	n, err := strconv.ParseUint(port, 10, 16) // digits only: no sign, no service name
	if err != nil || n > 65535 {
		return fmt.Errorf("%q: the port must be a number from 0 to 65535", addr)
	}
	return nil
}

// Loopback reports whether host names this machine only: localhost or a
// loopback address, with or without a port, brackets or a trailing dot.
// It is the one rule for a listen address that needs no token and for a
// Host a token-less port answers.
func Loopback(host string) bool {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.Trim(host, "[]"), ".")
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.IsLoopback()
}
