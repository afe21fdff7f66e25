package upstream

import (
	"context"
	"net"
	"net/netip"
	"time"
)

// LookupFunc resolves a host name to its addresses, like
// net.Resolver.LookupNetIP: network is "ip", "ip4" or "ip6".
type LookupFunc func(ctx context.Context, network, host string) ([]netip.Addr, error)

// fallbackDelay is how long the first address family has to itself before
// the other one is tried alongside it (RFC 8305 Happy Eyeballs; net.Dialer's
// default).
const fallbackDelay = 300 * time.Millisecond

// minAttempt is the least time one address gets while others wait their
// turn, as in net.Dialer.
const minAttempt = 2 * time.Second

// dialDirect connects to addr from this host. A host name is resolved with
// k.lookup, the one place where this process looks up an origin's name,
// and its addresses are dialled as net.Dialer would (in order within a
// family, the other family after fallbackDelay or the first family's
// failure), each by address, so that the dial-time guard sees every one.
// The dial timeout covers the lookup and every attempt.
func (k *connKit) dialDirect(ctx context.Context, network, addr string) (net.Conn, error) {
	if d := k.direct.Timeout; d > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d)
		defer cancel()
	}
	c, err := k.dialOrigin(ctx, network, addr)
	if err != nil {
		return nil, &DialError{Op: "dial " + addr, Err: err}
	}
	return k.idle(c), nil
}

func (k *connKit) dialOrigin(ctx context.Context, network, addr string) (net.Conn, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, &net.OpError{Op: "dial", Net: network, Err: err}
	}
	if _, err := netip.ParseAddr(host); err == nil {
		return k.direct.DialContext(ctx, network, addr)
	}
	family := "ip"
	switch network {
	case "tcp4":
		family = "ip4"
	case "tcp6":
		family = "ip6"
	}
	ips, err := k.lookup(ctx, family, host)
	if err == nil && len(ips) == 0 {
		err = &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
	}
	if err != nil {
		return nil, &net.OpError{Op: "dial", Net: network, Err: err}
	}
	// LookupNetIP may answer IPv4 addresses in their IPv4-mapped IPv6
	// form: dial (and sort by family) the address they stand for.
	addrs := make([]netip.Addr, len(ips))
	for i, ip := range ips {
		addrs[i] = ip.Unmap()
	}
	return k.dialAddrs(ctx, network, addrs, port)
}

// dialAddrs races the first address family against the other, started
// after fallbackDelay or as soon as the first one fails.
func (k *connKit) dialAddrs(ctx context.Context, network string, ips []netip.Addr, port string) (net.Conn, error) {
	var primaries, fallbacks []netip.Addr
	for _, ip := range ips {
		if ip.Is4() == ips[0].Is4() {
			primaries = append(primaries, ip)
		} else {
			fallbacks = append(fallbacks, ip)
		}
	}
	if len(fallbacks) == 0 {
		return k.dialSerial(ctx, network, primaries, port)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		c   net.Conn
		err error
	}
	// Each racer reports exactly once into a channel large enough that
	// neither can block.
	results := make(chan result, 2)
	race := func(list []netip.Addr) {
		c, err := k.dialSerial(ctx, network, list, port)
		results <- result{c, err}
	}
	go race(primaries)
	timer := time.NewTimer(fallbackDelay)
	defer timer.Stop()
	started, pending := false, 1
	var firstErr error
	for {
		select {
		case <-timer.C:
		case r := <-results:
			pending--
			if r.err == nil {
				if pending > 0 {
					// The loser ends at once (ctx is cancelled on
					// return); a connection it made regardless is closed.
					go func() {
						if r := <-results; r.c != nil {
							r.c.Close()
						}
					}()
				}
				return r.c, nil
			}
			if firstErr == nil {
				firstErr = r.err
			}
			if started && pending == 0 {
				return nil, firstErr
			}
		}
		if !started {
			started = true
			pending++
			go race(fallbacks)
		}
	}
}

// dialSerial tries ips in order, each with a share of the time left.
func (k *connKit) dialSerial(ctx context.Context, network string, ips []netip.Addr, port string) (net.Conn, error) {
	var firstErr error
	for i, ip := range ips {
		if err := ctx.Err(); err != nil {
			if firstErr == nil {
				firstErr = &net.OpError{Op: "dial", Net: network, Err: err}
			}
			break
		}
		dctx, cancel := ctx, context.CancelFunc(func() {})
		if deadline, ok := ctx.Deadline(); ok {
			left := time.Until(deadline)
			share := max(left/time.Duration(len(ips)-i), min(minAttempt, left))
			dctx, cancel = context.WithTimeout(ctx, share)
		}
		c, err := k.direct.DialContext(dctx, network, net.JoinHostPort(ip.String(), port))
		cancel()
		if err == nil {
			return c, nil
		}
		if firstErr == nil {
			firstErr = err
		}
	}
	return nil, firstErr
}
