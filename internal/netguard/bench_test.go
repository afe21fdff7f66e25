package netguard

import (
	"net/netip"
	"testing"
)

func BenchmarkCheckIP(b *testing.B) {
	g := mustNew(b, Config{AllowCIDRs: []string{"10.1.0.0/16", "127.0.0.1/32", "fd00::/8"}})
	for _, bc := range []struct {
		name    string
		ip      string
		blocked bool
	}{
		{"public-v4", "93.184.216.34", false},
		{"public-v6", "2606:4700:4700::1111", false},
		{"mapped-public", "::ffff:8.8.8.8", false},
		{"6to4-public", "2002:808:808::1", false},
		{"allow-cidr", "10.1.2.3", false},
		{"blocked", "169.254.169.254", true}, // allocates the *BlockedError
	} {
		ip := netip.MustParseAddr(bc.ip)
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if err := g.CheckIP(ip); (err != nil) != bc.blocked {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkParseLiteral(b *testing.B) {
	for _, bc := range []struct {
		name, host string
		ok         bool
	}{
		{"dotted", "93.184.216.34", true},
		{"decimal", "2130706433", true},
		{"hex-parts", "0x7f.0.0.1", true},
		{"ipv6", "[2606:4700:4700::1111]", true},
		{"ipv6-zone", "fe80::1%eth0", true},
		{"hostname", "www.example.com", false},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, ok := ParseLiteral(bc.host); ok != bc.ok {
					b.Fatal(bc.host)
				}
			}
		})
	}
}
