package netguard

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"syscall"

	"github.com/seed-a3c387e8/onceproxy/internal/hostmatch"
)

// Config is the `guard:` config section. The zero value blocks every
// address that is not public.
type Config struct {
	// AllowPrivate lets the proxy reach every non-public address (a proxy
	// for a lab). Unspecified, multicast and broadcast addresses stay
	// blocked: they are not hosts to connect to. Default false.
	AllowPrivate bool `yaml:"allow_private"`
	// AllowCIDRs are ranges reachable even though they are not public
	// ("127.0.0.1/32" for tests and local dev). A bare address is a
	// single-address range. They are matched against the unmapped address,
	// so "127.0.0.1/32" also allows ::ffff:127.0.0.1 (but not the NAT64,
	// 6to4 or IPv4-compatible forms, which are reached through other
	// hosts). They cannot allow unspecified, multicast or broadcast
	// addresses. Default none.
	AllowCIDRs []string `yaml:"allow_cidrs"`
	// AllowHosts are host names whose resolved addresses are not checked:
	// exact ("metadata.lab") or a wildcard for every name below a domain
	// ("*.internal.example" matches "a.internal.example" and
	// "a.b.internal.example" but not "internal.example"). Case and a
	// trailing dot do not matter. Default none.
	AllowHosts []string `yaml:"allow_hosts"`
}

// neverPrefixes are the ranges whose addresses are never allowed; an
// allow_cidrs entry entirely inside one of them is a mistake.
var neverPrefixes = []netip.Prefix{
	mustPrefix("0.0.0.0/8"),
	mustPrefix("224.0.0.0/4"),
	mustPrefix("255.255.255.255/32"),
	mustPrefix("::/128"),
	mustPrefix("ff00::/8"),
}

// Validate reports every problem in c, each prefixed by its yaml key
// ("allow_cidrs[1]: ...").
func (c Config) Validate() error {
	var errs []error
	for i, s := range c.AllowCIDRs {
		if _, err := parseAllowCIDR(s); err != nil {
			errs = append(errs, fmt.Errorf("allow_cidrs[%d]: %w", i, err))
		}
	}
	for i, s := range c.AllowHosts {
		if err := checkAllowHost(s); err != nil {
			errs = append(errs, fmt.Errorf("allow_hosts[%d]: %w", i, err))
		}
	}
	return errors.Join(errs...)
}

// parseAllowCIDR parses an allow_cidrs entry. An IPv4-mapped range
// ("::ffff:10.0.0.0/104") becomes the IPv4 range it stands for, since
// addresses are matched unmapped.
func parseAllowCIDR(s string) (netip.Prefix, error) {
	var p netip.Prefix
	if strings.Contains(s, "/") {
		var err error
		if p, err = netip.ParsePrefix(s); err != nil {
			return p, fmt.Errorf("invalid range %q: want a CIDR like \"10.0.0.0/8\" or an address like \"127.0.0.1\"", s)
		}
		if m := p.Masked(); m != p {
			return p, fmt.Errorf("range %q has bits set past the prefix length; did you mean %q?", s, m)
		}
	} else {
		ip, err := netip.ParseAddr(s)
		if err != nil || ip.Zone() != "" {
			return p, fmt.Errorf("invalid range %q: want a CIDR like \"10.0.0.0/8\" or an address like \"127.0.0.1\"", s)
		}
		p = netip.PrefixFrom(ip, ip.BitLen())
	}
	if p.Addr().Is4In6() && p.Bits() >= 96 {
		p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
	}
	for _, np := range neverPrefixes {
		if np.Bits() <= p.Bits() && np.Contains(p.Addr()) {
			return p, fmt.Errorf("range %q is %s, which is never allowed", s, Classify(p.Addr()))
		}
	}
	return p, nil
}

// checkAllowHost checks an allow_hosts entry: a host pattern like every
// other in the configuration (hostmatch), but neither "*" nor an IP
// address, which have settings of their own.
func checkAllowHost(s string) error {
	switch {
	case s == "*":
		return errors.New(`"*" would turn the guard off; use allow_private`)
	case isLiteral(s):
		return fmt.Errorf("%q is an IP address; put it in allow_cidrs", s)
	}
	return hostmatch.Valid(s)
}

// A Guard decides which addresses the proxy may connect to. It is
// immutable and safe for concurrent use. A nil *Guard, like a Guard from
// New(Config{}), blocks every address that is not public.
type Guard struct {
	allowPrivate bool
	cidrs        []netip.Prefix // unmapped
	hosts        *hostmatch.Set // AllowHosts
}

// defaultGuard is what a nil *Guard behaves as.
var defaultGuard Guard

// New compiles c. It fails with c.Validate's error.
func New(c Config) (*Guard, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	hosts, err := hostmatch.Compile(c.AllowHosts)
	if err != nil {
		return nil, fmt.Errorf("allow_hosts%w", err)
	}
	g := &Guard{allowPrivate: c.AllowPrivate, hosts: hosts}
	for _, s := range c.AllowCIDRs {
		p, _ := parseAllowCIDR(s)
		g.cidrs = append(g.cidrs, p)
	}
	return g, nil
}

// CheckIP returns nil if the guard lets the proxy connect to ip, else a
// *BlockedError. It does not allocate when ip is allowed.
func (g *Guard) CheckIP(ip netip.Addr) error {
	return g.check("", ip)
}

func (g *Guard) check(host string, ip netip.Addr) error {
	if g == nil {
		g = &defaultGuard
	}
	ip = ip.WithZone("")
	c := classify(ip)
	if c.public() {
		return nil
	}
	if !c.never() {
		if g.allowPrivate {
			return nil
		}
		u := ip.Unmap()
		for _, p := range g.cidrs {
			if p.Contains(u) {
				return nil
			}
		}
	}
	return &BlockedError{Host: host, Addr: ip, Class: c.String()}
}

// invalidHost is the BlockedError.Class of a host that is neither a literal
// nor a valid host name.
const invalidHost = "invalid-host"

// CheckHost is the early check of a request's target host (without port).
// A literal IP in any notation ParseLiteral accepts is checked with CheckIP.
// A host that is neither a literal nor a valid DNS name ("256.1.1.1", "a b",
// "[127.0.0.1]") is refused with class "invalid-host": browsers reject such
// URLs, and other parsers may read them as addresses. A name in AllowHosts
// passes. Other names pass too, to be checked at dial time by Control,
// except the names conventionally bound to loopback (RFC 6761, /etc/hosts):
// "localhost", "*.localhost", "localhost.localdomain", "ip6-localhost" and
// "ip6-loopback" are checked as 127.0.0.1 or ::1.
//
// Use CheckHostContext to also mark the dial context of an AllowHosts name.
func (g *Guard) CheckHost(host string) error {
	_, err := g.checkHost(host)
	return err
}

// CheckHostContext is CheckHost that also returns ctx marked with
// AllowedContext when host is in AllowHosts, so that the dial of this
// request skips the address check. Use the returned context only for the
// request to host.
func (g *Guard) CheckHostContext(ctx context.Context, host string) (context.Context, error) {
	allowed, err := g.checkHost(host)
	if allowed {
		ctx = AllowedContext(ctx)
	}
	return ctx, err
}

// checkHost is CheckHost; allowed reports an AllowHosts match.
func (g *Guard) checkHost(host string) (allowed bool, err error) {
	if g == nil {
		g = &defaultGuard
	}
	if ip, ok := ParseLiteral(host); ok {
		return false, g.check(host, ip)
	}
	if !hostmatch.ValidName(host) || endsInNumber(host) {
		return false, &BlockedError{Host: host, Class: invalidHost}
	}
	name := hostmatch.Normalize(host)
	if g.hosts.Match(name) {
		return true, nil
	}
	switch {
	case name == "localhost" || name == "localhost.localdomain" || strings.HasSuffix(name, ".localhost"):
		// These resolve to both 127.0.0.1 and ::1; either being allowed is
		// enough here, since Control checks the one actually dialed.
		err := g.check(host, netip.IPv6Loopback())
		if err != nil {
			err = g.check(host, netip.AddrFrom4([4]byte{127, 0, 0, 1}))
		}
		return false, err
	case name == "ip6-localhost" || name == "ip6-loopback":
		return false, g.check(host, netip.IPv6Loopback())
	}
	return false, nil
}

// Control is for net.Dialer.ControlContext. It parses address, the resolved
// "ip:port" about to be connected to, and applies CheckIP, unless ctx was
// marked by AllowedContext. It fails closed: an address that is not an
// "ip:port" (a Unix socket path) is refused. It never touches c.
//
// net.Dialer wraps the error in a *net.OpError; errors.As still finds the
// *BlockedError.
func (g *Guard) Control(ctx context.Context, network, address string, c syscall.RawConn) error {
	if allowed(ctx) {
		return nil
	}
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return fmt.Errorf("netguard: refusing %s dial to %q: not an ip:port address", network, address)
	}
	return g.check("", ap.Addr())
}

type allowedKey struct{}

// AllowedContext marks ctx so that Control lets its dials through. It is
// meant for the dial of one request to an AllowHosts name, whose resolved
// addresses are deliberately unchecked: every dial made with ctx or a
// context derived from it skips the check.
func AllowedContext(ctx context.Context) context.Context {
	return context.WithValue(ctx, allowedKey{}, true)
}

func allowed(ctx context.Context) bool {
	return ctx != nil && ctx.Value(allowedKey{}) != nil
}

// BlockedError says which address was refused and why. The proxy answers
// 403 with Error() as the reason.
type BlockedError struct {
	// Host is the request's host as written ("2130706433", "localhost"),
	// or "" when only the address is known (CheckIP, Control).
	Host string
	// Addr is the refused address, without zone; the zero Addr for an
	// invalid host.
	Addr netip.Addr
	// Class is Classify(Addr), or "invalid-host" for a host that is neither
	// an IP literal nor a host name.
	Class string
}

// notes name the well-known services behind some addresses.
var notes = map[netip.Addr]string{
	netip.MustParseAddr("169.254.169.254"): "cloud metadata",
	netip.MustParseAddr("169.254.170.2"):   "ECS task metadata",
	netip.MustParseAddr("100.100.100.200"): "cloud metadata",
	netip.MustParseAddr("fd00:ec2::254"):   "cloud metadata",
}

// Error reads like
// "refusing to connect to 169.254.169.254 (link-local: cloud metadata); allow it with guard.allow_cidrs".
func (e *BlockedError) Error() string {
	var b strings.Builder
	b.WriteString("refusing to connect to ")
	addr := ""
	if e.Addr.IsValid() {
		addr = e.Addr.String()
	}
	host := strings.TrimSuffix(strings.TrimPrefix(e.Host, "["), "]")
	switch {
	case e.Host == "" || host == addr:
		b.WriteString(addr)
	case e.Class == invalidHost || !printable(e.Host):
		b.WriteString(strconv.Quote(e.Host))
	default:
		b.WriteString(e.Host)
	}
	if e.Host != "" && host != addr && addr != "" {
		b.WriteString(" = " + addr)
	}
	b.WriteString(" (" + e.Class)
	if note := notes[e.Addr.Unmap()]; note != "" {
		b.WriteString(": " + note)
	}
	b.WriteString(")")
	switch {
	case e.Class == invalidHost:
		if endsInNumber(e.Host) {
			b.WriteString("; it is not a valid IPv4 address")
		} else {
			b.WriteString("; it is not a valid host name")
		}
	case classify(e.Addr).never():
		b.WriteString("; this address is never allowed")
	case e.Host != "" && !isLiteral(e.Host):
		b.WriteString("; allow it with guard.allow_cidrs or guard.allow_hosts")
	default:
		b.WriteString("; allow it with guard.allow_cidrs")
	}
	return b.String()
}

// HTTPStatus is the status the proxy answers a blocked request with: 403.
func (e *BlockedError) HTTPStatus() int { return http.StatusForbidden }

func isLiteral(host string) bool {
	_, ok := ParseLiteral(host)
	return ok
}

// printable reports whether s is safe to put in a message unquoted.
func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] <= ' ' || s[i] >= 0x7f {
			return false
		}
	}
	return true
}
