package netguard

import (
	"errors"
	"net/netip"
	"strconv"
	"testing"
)

// FuzzParseLiteral checks that ParseLiteral never panics and that the early
// and the dial-time checks agree on every literal it accepts.
func FuzzParseLiteral(f *testing.F) {
	for _, tc := range parseLiteralTests {
		f.Add(tc.in)
	}
	for _, tc := range classifyTests {
		f.Add(tc.ip)
	}
	guards := []*Guard{
		mustNew(f, Config{}),
		mustNew(f, Config{AllowPrivate: true}),
		mustNew(f, Config{AllowCIDRs: []string{"127.0.0.0/8", "10.0.0.0/8", "::1/128", "fe80::/10"}}),
	}
	f.Fuzz(func(t *testing.T, s string) {
		ip, ok := ParseLiteral(s)
		for _, g := range guards {
			hostErr := g.CheckHost(s) // must not panic either way
			if !ok {
				continue
			}
			ipErr := g.CheckIP(ip)
			if (hostErr == nil) != (ipErr == nil) {
				t.Fatalf("CheckHost(%q) = %v but CheckIP(%v) = %v", s, hostErr, ip, ipErr)
			}
			if hostErr != nil {
				var h, i *BlockedError
				if !errors.As(hostErr, &h) || !errors.As(ipErr, &i) || h.Class != i.Class || h.Addr != i.Addr {
					t.Fatalf("CheckHost(%q) = %v but CheckIP(%v) = %v", s, hostErr, ip, ipErr)
				}
				_ = h.Error()
			}
		}
		if !ok {
			return
		}
		if !ip.IsValid() || ip.Zone() != "" {
			t.Fatalf("ParseLiteral(%q) = %#v: want a valid address without zone", s, ip)
		}

		// Classify is stable for the unmapped form.
		c, cu := Classify(ip), Classify(ip.Unmap())
		if ip.Is4In6() {
			want := ""
			if cu != "" {
				want = "ipv4-mapped(" + cu + ")"
			}
			if c != want {
				t.Fatalf("Classify(%v) = %q; Classify(%v) = %q", ip, c, ip.Unmap(), cu)
			}
		} else if c != cu {
			t.Fatalf("Classify(%v) = %q changed to %q by Unmap", ip, c, cu)
		}
		if c == "" && !ip.Unmap().IsGlobalUnicast() {
			t.Fatalf("Classify(%v) = public; net/netip says it is not global unicast", ip)
		}

		// Every notation of an IPv4 address is the same address.
		if ip.Is4() {
			a := ip.As4()
			n := uint64(a[0])<<24 | uint64(a[1])<<16 | uint64(a[2])<<8 | uint64(a[3])
			for _, alt := range []string{
				ip.String(),
				strconv.FormatUint(n, 10),
				"0x" + strconv.FormatUint(n, 16),
				"0" + strconv.FormatUint(n, 8),
				ip.String() + ".",
			} {
				if got, ok := ParseLiteral(alt); !ok || got != ip {
					t.Fatalf("ParseLiteral(%q) = %v, %v; want %v (from %q)", alt, got, ok, ip, s)
				}
			}
		}
		// Where net/netip parses the string too, it finds the same address.
		if want, err := netip.ParseAddr(s); err == nil && want.WithZone("") != ip {
			t.Fatalf("ParseLiteral(%q) = %v; netip.ParseAddr says %v", s, ip, want)
		}
	})
}
