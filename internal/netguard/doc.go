// Package netguard keeps the proxy from being turned against the network it
// lives in (server-side request forgery): a client must not be able to reach
// the proxy host's loopback services, the private network, link-local
// addresses such as the cloud metadata service at 169.254.169.254, or any
// other address that is not public, by asking the proxy for it.
//
// # Two checks
//
// [Guard.CheckHost] runs early, on the host of each request (absolute-form
// URL, CONNECT authority, SOCKS5 domain; a SOCKS5 address goes to
// [Guard.CheckIP]). It normalizes IP literals in every notation browsers and
// libc accept ("2130706433", "0x7f.1", "0177.0.0.1", "[::ffff:7f00:1]", see
// [ParseLiteral]) and refuses non-public ones with a clear 403 before any DNS
// lookup. It also refuses hosts that are neither literals nor host names,
// and the names conventionally bound to loopback ("localhost"). Other
// names pass.
//
// [Guard.Control] runs at dial time, as net.Dialer.ControlContext, on the IP
// address actually being connected to. This is the check that matters: the
// name was resolved by then, so neither a name that resolves to 10.0.0.1 nor
// DNS rebinding (a public answer to the first lookup, a private one to the
// next) can slip through, and every Happy Eyeballs attempt is checked.
//
//	g, err := netguard.New(cfg.Guard)
//	dialer := &net.Dialer{ControlContext: g.Control}
//	// per request, before dialing:
//	ctx, err := g.CheckHostContext(req.Context(), req.URL.Hostname())
//	if be := (*netguard.BlockedError)(nil); errors.As(err, &be) { /* 403, be.Error() */ }
//
// Names in Config.AllowHosts pass CheckHost, and CheckHostContext marks the
// request's context with [AllowedContext] so that Control skips the dial.
//
// # What is blocked
//
// Every address [Classify] names: unspecified, loopback, private (RFC 1918,
// fc00::/7), link-local, deprecated site-local fec0::/10, CGNAT
// 100.64.0.0/10, multicast, broadcast, reserved (240.0.0.0/4, IPv6 outside
// 2000::/3), documentation, benchmarking, IETF protocol assignments
// (192.0.0.0/24, 2001::/23), discard-only 100::/64, Teredo and the local-use
// NAT64 prefix. AllowPrivate and AllowCIDRs lift the block, except for
// unspecified, multicast and broadcast addresses (and invalid ones), which
// stay blocked whatever the config: they are not hosts one can connect to,
// and connect(2) to 0.0.0.0 reaches the local host on Linux and macOS.
//
// IPv6 forms that make the connection go to an IPv4 address are checked
// through that address:
//
//   - ::ffff:a.b.c.d (IPv4-mapped) is a.b.c.d on a dual-stack socket: public
//     if a.b.c.d is, else "ipv4-mapped(<class>)". AllowCIDRs match the
//     unmapped address.
//   - 64:ff9b::a.b.c.d (well-known NAT64) and 2002:AABB:CCDD::/48 (6to4) are
//     public if the embedded address is, else "nat64(<class>)" or
//     "6to4(<class>)": a NAT64 gateway or 6to4 tunnel connects to it.
//   - ::a.b.c.d (IPv4-compatible, deprecated) and 2001::/32 (Teredo, client
//     address inverted in the low 32 bits) are never public, and are named
//     "ipv4-compatible(<class>)" or "teredo(<class>)" when the embedded
//     address is not public either.
//   - 64:ff9b:1::/48 (local-use NAT64) is never public; where it carries the
//     IPv4 address depends on the operator's prefix length, so nothing is
//     extracted.
//
// # What it does not protect against
//
//   - Requests sent through an upstream proxy: the dial goes to the upstream
//     proxy, and what the upstream resolves the target name to is out of
//     sight; only CheckHost's early check applies. If the upstream proxy's
//     own address is private, list it in AllowCIDRs or dial it with a dialer
//     without Control.
//   - Sensitive public addresses: the proxy host's own public address (which
//     reaches its listeners), platform endpoints on public addresses such as
//     Azure's 168.63.129.16, or a partner's allow-listed service. The guard
//     has no deny list; use an egress firewall.
//   - AllowHosts names: their resolved addresses are trusted, so whoever
//     controls their DNS controls where the proxy connects. The mark set by
//     AllowedContext covers every dial made with that context and the
//     contexts derived from it; mark only the context of one request to
//     that name.
//   - Anything not dialed through a guarded net.Dialer. Do not install
//     Control on the resolver's dialer: the resolver legitimately talks to
//     127.0.0.53 or a private DNS server.
package netguard
