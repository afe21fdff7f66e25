package netguard

import (
	"encoding/binary"
	"net/netip"
)

// base is the reason an address is not public. The zero value means public.
type base uint8

const (
	public base = iota
	invalid
	unspecified
	loopback
	private
	linkLocal
	cgnat
	ietfProtocol
	documentation
	benchmarking
	multicast
	broadcast
	reserved
	siteLocal
	discard
	teredo
	nat64Local
	numBases
)

var baseNames = [numBases]string{
	public:        "",
	invalid:       "invalid",
	unspecified:   "unspecified",
	loopback:      "loopback",
	private:       "private",
	linkLocal:     "link-local",
	cgnat:         "cgnat",
	ietfProtocol:  "ietf-protocol",
	documentation: "documentation",
	benchmarking:  "benchmarking",
	multicast:     "multicast",
	broadcast:     "broadcast",
	reserved:      "reserved",
	siteLocal:     "site-local",
	discard:       "discard",
	teredo:        "teredo",
	nat64Local:    "nat64-local",
}

// embed is how an IPv6 address carries an IPv4 address that was classified
// in its stead (see the package doc for why each form is or is not checked).
type embed uint8

const (
	direct     embed = iota // nothing embedded
	mapped                  // ::ffff:a.b.c.d (RFC 4291 §2.5.5.2)
	compatible              // ::a.b.c.d (RFC 4291 §2.5.5.1, deprecated)
	nat64                   // 64:ff9b::a.b.c.d (RFC 6052)
	sixToFour               // 2002:aabb:ccdd::/48 (RFC 3056)
	teredoNAT               // 2001:0::/32, client address inverted in the low 32 bits (RFC 4380)
	numEmbeds
)

var embedNames = [numEmbeds]string{
	mapped:     "ipv4-mapped",
	compatible: "ipv4-compatible",
	nat64:      "nat64",
	sixToFour:  "6to4",
	teredoNAT:  "teredo",
}

// class is the full classification: the base reason, and the IPv6 form the
// reason was found in, if the address embeds an IPv4 address.
type class struct {
	embed embed
	base  base
}

func (c class) public() bool { return c.base == public }

// never reports whether c is blocked even with AllowPrivate or a matching
// AllowCIDRs entry: none of these is a host one can meaningfully connect to,
// and connect(2) to an unspecified address reaches the local host on Linux
// and macOS.
func (c class) never() bool {
	switch c.base {
	case invalid, unspecified, multicast, broadcast:
		return true
	}
	return false
}

// String returns the class name without allocating.
func (c class) String() string { return classNames[c.embed][c.base] }

// classNames holds every name Classify can return, so it never allocates.
var classNames = func() (t [numEmbeds][numBases]string) {
	for e := range numEmbeds {
		for b := range numBases {
			switch {
			case e == direct:
				t[e][b] = baseNames[b]
			case b != public:
				t[e][b] = embedNames[e] + "(" + baseNames[b] + ")"
			}
		}
	}
	return t
}()

type v4Range struct {
	prefix netip.Prefix
	base   base
}

// v4Ranges lists every IPv4 range that is not public. Order matters only
// where ranges overlap: the first match wins.
var v4Ranges = []v4Range{
	// RFC 1122 "this network". Linux and macOS treat connect(0.0.0.0) as
	// connect(127.0.0.1), so it is never allowed.
	{mustPrefix("0.0.0.0/8"), unspecified},
	{mustPrefix("10.0.0.0/8"), private},       // RFC 1918
	{mustPrefix("100.64.0.0/10"), cgnat},      // RFC 6598 shared address space; 100.100.100.200 is Alibaba Cloud metadata
	{mustPrefix("127.0.0.0/8"), loopback},     // RFC 1122
	{mustPrefix("169.254.0.0/16"), linkLocal}, // RFC 3927; 169.254.169.254 is the cloud metadata service
	{mustPrefix("172.16.0.0/12"), private},    // RFC 1918
	// RFC 6890 IETF protocol assignments: DS-Lite, NAT64 discovery, PCP
	// and TURN anycast. A scraper has no business with any of them.
	{mustPrefix("192.0.0.0/24"), ietfProtocol},
	{mustPrefix("192.0.2.0/24"), documentation},    // RFC 5737 TEST-NET-1
	{mustPrefix("192.88.99.0/24"), reserved},       // 6to4 relay anycast, deprecated by RFC 7526
	{mustPrefix("192.168.0.0/16"), private},        // RFC 1918
	{mustPrefix("198.18.0.0/15"), benchmarking},    // RFC 2544
	{mustPrefix("198.51.100.0/24"), documentation}, // RFC 5737 TEST-NET-2
	{mustPrefix("203.0.113.0/24"), documentation},  // RFC 5737 TEST-NET-3
	{mustPrefix("224.0.0.0/4"), multicast},         // RFC 5771
	{mustPrefix("255.255.255.255/32"), broadcast},  // RFC 919; before 240/4
	{mustPrefix("240.0.0.0/4"), reserved},          // RFC 1112 class E
}

type v6Range struct {
	prefix netip.Prefix
	// base is the class of the whole range, or for a range with an embedded
	// IPv4 address the class when that address is public.
	base  base
	embed embed
}

// v6Ranges lists the IPv6 ranges handled specially. Anything else outside
// 2000::/3, the only block IANA allocates global unicast from, is reserved.
// The first match wins.
var v6Ranges = []v6Range{
	{mustPrefix("::/128"), unspecified, direct},
	{mustPrefix("::1/128"), loopback, direct},
	// On a dual-stack socket ::ffff:a.b.c.d is a.b.c.d itself.
	{mustPrefix("::ffff:0:0/96"), public, mapped},
	// Deprecated and never public, but name the embedded class when there
	// is one: ::127.0.0.1 is more telling as ipv4-compatible(loopback).
	{mustPrefix("::/96"), reserved, compatible},
	// The well-known NAT64 prefix: a NAT64 gateway connects to the
	// embedded address for us, which is fine only if it is public.
	{mustPrefix("64:ff9b::/96"), public, nat64},
	// RFC 8215 local-use NAT64 prefix: never public, and where the IPv4
	// address sits depends on the operator's prefix length (RFC 6052 §2.2),
	// so nothing is extracted.
	{mustPrefix("64:ff9b:1::/48"), nat64Local, direct},
	{mustPrefix("100::/64"), discard, direct}, // RFC 6666 discard-only
	// Teredo: the relay forwards to the client's NAT, whose address is
	// stored inverted in the low 32 bits. Never public (a Teredo relay on
	// the proxy host could reach anything), but name a non-public client.
	{mustPrefix("2001::/32"), teredo, teredoNAT},
	{mustPrefix("2001:2::/48"), benchmarking, direct}, // RFC 5180
	// RFC 2928 IETF protocol assignments (ORCHID, AMT, AS112, PCP and
	// TURN anycast, ...); the first regional allocation is 2001:200::/23.
	{mustPrefix("2001::/23"), ietfProtocol, direct},
	{mustPrefix("2001:db8::/32"), documentation, direct}, // RFC 3849
	// 6to4: a 6to4 tunnel on the proxy host encapsulates to the embedded
	// address, which is fine only if it is public.
	{mustPrefix("2002::/16"), public, sixToFour},
	{mustPrefix("3fff::/20"), documentation, direct}, // RFC 9637
	// RFC 4193 unique local; fd00:ec2::254 is the AWS metadata service.
	{mustPrefix("fc00::/7"), private, direct},
	{mustPrefix("fe80::/10"), linkLocal, direct}, // RFC 4291
	// RFC 3879 deprecated site-local: still routed inside some networks.
	{mustPrefix("fec0::/10"), siteLocal, direct},
	{mustPrefix("ff00::/8"), multicast, direct}, // RFC 4291
}

// globalUnicast6 is the only IPv6 block IANA allocates public addresses from.
var globalUnicast6 = compile6(v6Range{prefix: mustPrefix("2000::/3")})

func mustPrefix(s string) netip.Prefix { return netip.MustParsePrefix(s) }

// The tables above compiled to integer compares, which run several times
// faster than netip.Prefix.Contains.
var (
	v4Table = compile4(v4Ranges)
	v6Table = func() []v6Match {
		t := make([]v6Match, len(v6Ranges))
		for i, r := range v6Ranges {
			t[i] = compile6(r)
		}
		return t
	}()
)

type v4Match struct {
	net, mask uint32
	base      base
}

func compile4(rs []v4Range) []v4Match {
	t := make([]v4Match, len(rs))
	for i, r := range rs {
		a := r.prefix.Addr().As4()
		t[i] = v4Match{binary.BigEndian.Uint32(a[:]), ^uint32(0) << (32 - r.prefix.Bits()), r.base}
	}
	return t
}

type v6Match struct {
	hi, lo, maskHi, maskLo uint64
	base                   base
	embed                  embed
}

func compile6(r v6Range) v6Match {
	a := r.prefix.Addr().As16()
	m := v6Match{hi: binary.BigEndian.Uint64(a[:8]), lo: binary.BigEndian.Uint64(a[8:]), base: r.base, embed: r.embed}
	if bits := r.prefix.Bits(); bits <= 64 {
		m.maskHi = ^uint64(0) << (64 - bits)
	} else {
		m.maskHi, m.maskLo = ^uint64(0), ^uint64(0)<<(128-bits)
	}
	return m
}

func (m *v6Match) contains(hi, lo uint64) bool {
	return hi&m.maskHi == m.hi && lo&m.maskLo == m.lo
}

// Classify names why ip is not a public address, or returns "" if it is.
//
// The names are "unspecified", "loopback", "private", "link-local",
// "site-local", "cgnat", "multicast", "broadcast", "reserved",
// "documentation", "benchmarking", "ietf-protocol", "discard", "teredo",
// "nat64-local" and, for an address that is not valid, "invalid". An IPv6
// address that embeds a non-public IPv4 address is named after the form and
// the embedded class: "ipv4-mapped(loopback)", "ipv4-compatible(private)",
// "nat64(link-local)", "6to4(private)", "teredo(loopback)".
//
// Classify ignores a zone and does not allocate.
func Classify(ip netip.Addr) string {
	return classify(ip).String()
}

func classify(ip netip.Addr) class {
	switch {
	case ip.Is4():
		return class{base: classify4(ip)}
	case ip.Is6():
		return classify6(ip)
	}
	return class{base: invalid}
}

func classify4(ip netip.Addr) base {
	a := ip.As4()
	x := binary.BigEndian.Uint32(a[:])
	for _, m := range v4Table {
		if x&m.mask == m.net {
			return m.base
		}
	}
	return public
}

func classify6(ip netip.Addr) class {
	a := ip.As16()
	hi, lo := binary.BigEndian.Uint64(a[:8]), binary.BigEndian.Uint64(a[8:])
	for i := range v6Table {
		m := &v6Table[i]
		if !m.contains(hi, lo) {
			continue
		}
		if m.embed == direct {
			return class{base: m.base}
		}
		inner := classify4(embedded(a, m.embed))
		if inner == public {
			return class{base: m.base}
		}
		return class{embed: m.embed, base: inner}
	}
	if !globalUnicast6.contains(hi, lo) {
		return class{base: reserved}
	}
	return class{}
}

// embedded extracts the IPv4 address that the IPv6 address a carries in form e.
func embedded(a [16]byte, e embed) netip.Addr {
	switch e {
	case sixToFour:
		return netip.AddrFrom4([4]byte(a[2:6]))
	case teredoNAT:
		return netip.AddrFrom4([4]byte{^a[12], ^a[13], ^a[14], ^a[15]})
	}
	return netip.AddrFrom4([4]byte(a[12:16]))
}
