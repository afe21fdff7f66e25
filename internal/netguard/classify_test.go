package netguard

import (
	"math/rand/v2"
	"net/netip"
	"testing"
)

// classifyTests covers every range, IPv4 and IPv6 where both exist, with
// boundaries on either side of the trickier ones.
var classifyTests = []struct {
	ip, want string
}{
	// unspecified
	{"0.0.0.0", "unspecified"},
	{"0.1.2.3", "unspecified"},
	{"0.255.255.255", "unspecified"},
	{"::", "unspecified"},
	// loopback
	{"127.0.0.1", "loopback"},
	{"127.255.255.254", "loopback"},
	{"::1", "loopback"},
	// private
	{"10.0.0.1", "private"},
	{"10.255.255.255", "private"},
	{"172.16.0.1", "private"},
	{"172.31.255.255", "private"},
	{"192.168.1.1", "private"},
	{"fc00::1", "private"},
	{"fd12:3456::1", "private"},
	{"fd00:ec2::254", "private"},
	// link-local
	{"169.254.169.254", "link-local"},
	{"169.254.0.1", "link-local"},
	{"fe80::1", "link-local"},
	{"fe80::1%eth0", "link-local"},
	{"febf:ffff::1", "link-local"},
	// site-local (IPv6 only)
	{"fec0::1", "site-local"},
	{"feff::1", "site-local"},
	// CGNAT (IPv4 only)
	{"100.64.0.1", "cgnat"},
	{"100.100.100.200", "cgnat"},
	{"100.127.255.255", "cgnat"},
	// multicast
	{"224.0.0.1", "multicast"},
	{"239.255.255.250", "multicast"},
	{"ff02::1", "multicast"},
	{"ff05::1:3", "multicast"},
	// broadcast (IPv4 only)
	{"255.255.255.255", "broadcast"},
	// reserved
	{"240.0.0.1", "reserved"},
	{"255.255.255.254", "reserved"},
	{"192.88.99.1", "reserved"},
	{"4000::1", "reserved"},
	{"5f00::1", "reserved"},
	{"100:0:0:1::1", "reserved"},
	{"1fff:ffff::1", "reserved"},
	{"::ffff:0:7f00:1", "reserved"}, // SIIT "IPv4-translated", not mapped
	{"::8.8.8.8", "reserved"},       // IPv4-compatible with a public address
	// documentation
	{"192.0.2.1", "documentation"},
	{"198.51.100.1", "documentation"},
	{"203.0.113.255", "documentation"},
	{"2001:db8::1", "documentation"},
	{"3fff::1", "documentation"},
	// benchmarking
	{"198.18.0.1", "benchmarking"},
	{"198.19.255.255", "benchmarking"},
	{"2001:2::1", "benchmarking"},
	// IETF protocol assignments
	{"192.0.0.1", "ietf-protocol"},
	{"192.0.0.170", "ietf-protocol"},
	{"2001:1::1", "ietf-protocol"},
	{"2001:10::1", "ietf-protocol"},
	{"2001:1ff::1", "ietf-protocol"},
	// discard-only
	{"100::1", "discard"},
	// IPv4-mapped: the embedded address decides
	{"::ffff:127.0.0.1", "ipv4-mapped(loopback)"},
	{"::ffff:169.254.169.254", "ipv4-mapped(link-local)"},
	{"::ffff:10.0.0.1", "ipv4-mapped(private)"},
	{"::ffff:0.0.0.0", "ipv4-mapped(unspecified)"},
	{"::ffff:255.255.255.255", "ipv4-mapped(broadcast)"},
	{"::ffff:8.8.8.8", ""},
	// IPv4-compatible
	{"::127.0.0.1", "ipv4-compatible(loopback)"},
	{"::10.0.0.1", "ipv4-compatible(private)"},
	{"::0.0.0.2", "ipv4-compatible(unspecified)"},
	// NAT64
	{"64:ff9b::7f00:1", "nat64(loopback)"},
	{"64:ff9b::169.254.169.254", "nat64(link-local)"},
	{"64:ff9b::808:808", ""},
	{"64:ff9b:1::1", "nat64-local"},
	{"64:ff9b:1:ffff::8.8.8.8", "nat64-local"},
	// 6to4
	{"2002:7f00:1::1", "6to4(loopback)"},
	{"2002:c0a8:101::1", "6to4(private)"},
	{"2002:a9fe:a9fe::", "6to4(link-local)"},
	{"2002:808:808::1", ""},
	// Teredo: client 127.0.0.1 inverted is 80ff:fffe, 8.8.8.8 is f7f7:f7f7.
	{"2001:0:4136:e378:8000:63bf:80ff:fffe", "teredo(loopback)"},
	{"2001:0:4136:e378:8000:63bf:f5ff:fffe", "teredo(private)"},
	{"2001:0:4136:e378:8000:63bf:f7f7:f7f7", "teredo"},
	// public, including the neighbours of blocked ranges
	{"8.8.8.8", ""},
	{"1.1.1.1", ""},
	{"93.184.216.34", ""},
	{"9.255.255.255", ""},
	{"11.0.0.0", ""},
	{"100.63.255.255", ""},
	{"100.128.0.0", ""},
	{"126.255.255.255", ""},
	{"128.0.0.0", ""},
	{"169.253.255.255", ""},
	{"172.15.255.255", ""},
	{"172.32.0.0", ""},
	{"192.0.1.255", ""},
	{"192.0.3.0", ""},
	{"192.167.255.255", ""},
	{"192.169.0.0", ""},
	{"198.17.255.255", ""},
	{"198.20.0.0", ""},
	{"223.255.255.255", ""},
	{"2606:4700:4700::1111", ""},
	{"2001:4860:4860::8888", ""},
	{"2001:200::1", ""},
	{"2a00:1450:4001::1", ""},
	{"3ffe::1", ""},
	{"2620:fe::fe", ""},
}

func TestClassify(t *testing.T) {
	for _, tc := range classifyTests {
		ip := netip.MustParseAddr(tc.ip)
		if got := Classify(ip); got != tc.want {
			t.Errorf("Classify(%s) = %q; want %q", tc.ip, got, tc.want)
		}
		// The mapped form of every IPv4 address is classified through it.
		if ip.Is4() {
			want := ""
			if tc.want != "" {
				want = "ipv4-mapped(" + tc.want + ")"
			}
			m := netip.AddrFrom16(ip.As16())
			if got := Classify(m); got != want {
				t.Errorf("Classify(%s) = %q; want %q", m, got, want)
			}
		}
	}
	if got := Classify(netip.Addr{}); got != "invalid" {
		t.Errorf("Classify(zero Addr) = %q; want %q", got, "invalid")
	}
}

// TestClassifyAgreesWithNetip checks, on random and structured addresses,
// that whatever net/netip considers loopback, private, link-local, multicast
// or unspecified is not public here.
func TestClassifyAgreesWithNetip(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	check := func(ip netip.Addr) {
		t.Helper()
		c := Classify(ip)
		special := ip.IsLoopback() || ip.IsPrivate() || ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() ||
			ip.IsInterfaceLocalMulticast() || ip.IsMulticast() || ip.IsUnspecified() || !ip.IsGlobalUnicast()
		if special && c == "" {
			t.Fatalf("Classify(%s) = public; net/netip says it is special", ip)
		}
	}
	for range 50_000 {
		var a4 [4]byte
		var a16 [16]byte
		for i := range a4 {
			a4[i] = byte(r.Uint32())
		}
		for i := range a16 {
			a16[i] = byte(r.Uint32())
		}
		check(netip.AddrFrom4(a4))
		check(netip.AddrFrom16(a16))
		check(netip.AddrFrom16(netip.AddrFrom4(a4).As16())) // mapped
		a16[0], a16[1] = 0, 0
		check(netip.AddrFrom16(a16)) // low space
	}
}

func TestClassifyAllocs(t *testing.T) {
	ips := []netip.Addr{
		netip.MustParseAddr("8.8.8.8"),
		netip.MustParseAddr("::ffff:127.0.0.1"),
		netip.MustParseAddr("2002:7f00:1::1"),
		netip.MustParseAddr("fe80::1%eth0"),
	}
	if n := testing.AllocsPerRun(100, func() {
		for _, ip := range ips {
			_ = Classify(ip)
		}
	}); n != 0 {
		t.Errorf("Classify allocates %v times; want 0", n)
	}
}

// TestCompiledTables checks that the integer tables match the prefix
// tables they were compiled from, on every range boundary and random
// addresses.
func TestCompiledTables(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	var ips []netip.Addr
	edges := func(p netip.Prefix) {
		first := p.Masked().Addr()
		last := first
		a := first.As16()
		if first.Is4() {
			b := first.As4()
			a = [16]byte{}
			copy(a[12:], b[:])
		}
		// Set every bit past the prefix length.
		off := 0
		if first.Is4() {
			off = 96
		}
		for i := p.Bits() + off; i < 128; i++ {
			a[i/8] |= 1 << (7 - i%8)
		}
		if first.Is4() {
			last = netip.AddrFrom4([4]byte(a[12:]))
		} else {
			last = netip.AddrFrom16(a)
		}
		ips = append(ips, first, last, first.Prev(), last.Next())
	}
	for _, v := range v4Ranges {
		edges(v.prefix)
	}
	for _, v := range v6Ranges {
		edges(v.prefix)
	}
	for range 20_000 {
		var a16 [16]byte
		for i := range a16 {
			a16[i] = byte(r.Uint32())
		}
		ips = append(ips, netip.AddrFrom4([4]byte(a16[:4])), netip.AddrFrom16(a16))
	}
	for _, ip := range ips {
		if !ip.IsValid() {
			continue
		}
		if ip.Is4() {
			a := ip.As4()
			x := uint32(a[0])<<24 | uint32(a[1])<<16 | uint32(a[2])<<8 | uint32(a[3])
			for i, v := range v4Ranges {
				if got, want := x&v4Table[i].mask == v4Table[i].net, v.prefix.Contains(ip); got != want {
					t.Fatalf("%s in %s: compiled %v, netip %v", ip, v.prefix, got, want)
				}
			}
			continue
		}
		a := ip.As16()
		hi := uint64(0)
		lo := uint64(0)
		for i := range 8 {
			hi = hi<<8 | uint64(a[i])
			lo = lo<<8 | uint64(a[8+i])
		}
		for i, v := range v6Ranges {
			if got, want := v6Table[i].contains(hi, lo), v.prefix.Contains(ip); got != want {
				t.Fatalf("%s in %s: compiled %v, netip %v", ip, v.prefix, got, want)
			}
		}
	}
}
