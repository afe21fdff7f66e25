package netguard

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"strings"
	"testing"
)

func mustNew(t testing.TB, c Config) *Guard {
	t.Helper()
	g, err := New(c)
	if err != nil {
		t.Fatalf("New(%+v): %v", c, err)
	}
	return g
}

// blockedClass returns "" for nil, the class of a *BlockedError, and fails
// the test for any other error.
func blockedClass(t *testing.T, err error) string {
	t.Helper()
	if err == nil {
		return ""
	}
	var be *BlockedError
	if !errors.As(err, &be) {
		t.Fatalf("error %v (%T) is not a *BlockedError", err, err)
	}
	return be.Class
}

func TestCheckIP(t *testing.T) {
	def := mustNew(t, Config{})
	lab := mustNew(t, Config{AllowPrivate: true})
	dev := mustNew(t, Config{AllowCIDRs: []string{"127.0.0.1/32", "10.1.0.0/16", "fd00::/8", "::ffff:192.168.7.0/120", "100.64.0.1"}})
	for _, tc := range []struct {
		ip            string
		def, lab, dev string // want class, "" if allowed
	}{
		{"8.8.8.8", "", "", ""},
		{"2606:4700:4700::1111", "", "", ""},
		{"::ffff:1.1.1.1", "", "", ""},
		{"127.0.0.1", "loopback", "", ""},
		{"::ffff:127.0.0.1", "ipv4-mapped(loopback)", "", ""},
		{"127.0.0.2", "loopback", "", "loopback"},
		{"::1", "loopback", "", "loopback"},
		{"::127.0.0.1", "ipv4-compatible(loopback)", "", "ipv4-compatible(loopback)"},
		{"64:ff9b::7f00:1", "nat64(loopback)", "", "nat64(loopback)"},
		{"10.1.2.3", "private", "", ""},
		{"10.2.0.1", "private", "", "private"},
		{"fd00:ec2::254", "private", "", ""},
		{"fc00::1", "private", "", "private"},
		{"192.168.7.9", "private", "", ""},
		{"192.168.8.9", "private", "", "private"},
		{"100.64.0.1", "cgnat", "", ""},
		{"100.64.0.2", "cgnat", "", "cgnat"},
		{"169.254.169.254", "link-local", "", "link-local"},
		{"fe80::1%eth0", "link-local", "", "link-local"},
		{"240.0.0.1", "reserved", "", "reserved"},
		{"2001:db8::1", "documentation", "", "documentation"},
		// never allowed, whatever the config
		{"0.0.0.0", "unspecified", "unspecified", "unspecified"},
		{"::", "unspecified", "unspecified", "unspecified"},
		{"::ffff:0.0.0.0", "ipv4-mapped(unspecified)", "ipv4-mapped(unspecified)", "ipv4-mapped(unspecified)"},
		{"224.0.0.1", "multicast", "multicast", "multicast"},
		{"ff02::1", "multicast", "multicast", "multicast"},
		{"255.255.255.255", "broadcast", "broadcast", "broadcast"},
	} {
		ip := netip.MustParseAddr(tc.ip)
		for _, g := range []struct {
			name  string
			guard *Guard
			want  string
		}{{"default", def, tc.def}, {"allow_private", lab, tc.lab}, {"allow_cidrs", dev, tc.dev}} {
			if got := blockedClass(t, g.guard.CheckIP(ip)); got != g.want {
				t.Errorf("%s: CheckIP(%s) blocked as %q; want %q", g.name, tc.ip, got, g.want)
			}
		}
	}
	if got := blockedClass(t, def.CheckIP(netip.Addr{})); got != "invalid" {
		t.Errorf("CheckIP(zero Addr) blocked as %q; want invalid", got)
	}
}

// TestAllowCIDRsCannotAllowNever checks that a range covering everything
// still leaves the never-allowed classes blocked.
func TestAllowCIDRsCannotAllowNever(t *testing.T) {
	g := mustNew(t, Config{AllowCIDRs: []string{"0.0.0.0/0", "::/0"}})
	for ip, want := range map[string]string{
		"10.0.0.1":        "",
		"fe80::1":         "",
		"0.0.0.0":         "unspecified",
		"::":              "unspecified",
		"239.1.1.1":       "multicast",
		"ff02::1":         "multicast",
		"255.255.255.255": "broadcast",
	} {
		if got := blockedClass(t, g.CheckIP(netip.MustParseAddr(ip))); got != want {
			t.Errorf("CheckIP(%s) blocked as %q; want %q", ip, got, want)
		}
	}
}

func TestNilGuardIsDefault(t *testing.T) {
	var g *Guard
	if err := g.CheckIP(netip.MustParseAddr("8.8.8.8")); err != nil {
		t.Errorf("nil Guard: CheckIP(8.8.8.8) = %v", err)
	}
	if got := blockedClass(t, g.CheckIP(netip.MustParseAddr("127.0.0.1"))); got != "loopback" {
		t.Errorf("nil Guard: CheckIP(127.0.0.1) blocked as %q; want loopback", got)
	}
	if got := blockedClass(t, g.CheckHost("localhost")); got != "loopback" {
		t.Errorf("nil Guard: CheckHost(localhost) blocked as %q; want loopback", got)
	}
	if got := blockedClass(t, g.Control(context.Background(), "tcp", "10.0.0.1:80", nil)); got != "private" {
		t.Errorf("nil Guard: Control(10.0.0.1:80) blocked as %q; want private", got)
	}
}

func TestCheckHost(t *testing.T) {
	def := mustNew(t, Config{})
	dev := mustNew(t, Config{AllowCIDRs: []string{"127.0.0.1/32"}})
	for _, tc := range []struct {
		host     string
		def, dev string // want class, "" if it passes
	}{
		// literals in every notation are checked as addresses
		{"127.0.0.1", "loopback", ""},
		{"2130706433", "loopback", ""},
		{"0x7f.1", "loopback", ""},
		{"0177.0.0.1", "loopback", ""},
		{"127.0.0.1.", "loopback", ""},
		{"[::ffff:7f00:1]", "ipv4-mapped(loopback)", ""},
		{"[::1]", "loopback", "loopback"},
		{"169.254.43518", "link-local", "link-local"},
		{"[fe80::1%eth0]", "link-local", "link-local"},
		{"0", "unspecified", "unspecified"},
		{"8.8.8.8", "", ""},
		{"134744072", "", ""},
		{"[2606:4700:4700::1111]", "", ""},
		// names pass, to be checked at dial time
		{"example.com", "", ""},
		{"Example.COM.", "", ""},
		{"1.example", "", ""},
		{"0x.com", "", ""},
		{"_dmarc.example.com", "", ""},
		{"127.0.0.1.nip.io", "", ""},
		// except loopback aliases
		{"localhost", "loopback", ""},
		{"LOCALHOST.", "loopback", ""},
		{"localhost.localdomain", "loopback", ""},
		{"app.localhost", "loopback", ""},
		{"ip6-localhost", "loopback", "loopback"},
		{"ip6-loopback", "loopback", "loopback"},
		{"notlocalhost", "", ""},
		// and hosts that are neither
		{"", "invalid-host", "invalid-host"},
		{"256.1.1.1", "invalid-host", "invalid-host"},
		{"4294967296", "invalid-host", "invalid-host"},
		{"1.2.3.4.5", "invalid-host", "invalid-host"},
		{"08.0.0.1", "invalid-host", "invalid-host"},
		{"example.1", "invalid-host", "invalid-host"},
		{"[127.0.0.1]", "invalid-host", "invalid-host"},
		{"127.0.0.1:80", "invalid-host", "invalid-host"},
		{"127.0.0.1 foo", "invalid-host", "invalid-host"},
		{"127.0.0.1%00", "invalid-host", "invalid-host"},
		{"exa mple.com", "invalid-host", "invalid-host"},
		{"a..b", "invalid-host", "invalid-host"},
		{".example.com", "invalid-host", "invalid-host"},
		{"localhost..", "invalid-host", "invalid-host"},
		{strings.Repeat("a", 64) + ".example", "invalid-host", "invalid-host"},
		{strings.Repeat("a", 63) + ".example", "", ""},
		{"１２７.０.０.１", "invalid-host", "invalid-host"},
		{"xn--e1afmkfd.xn--p1ai", "", ""},
	} {
		if got := blockedClass(t, def.CheckHost(tc.host)); got != tc.def {
			t.Errorf("default: CheckHost(%q) blocked as %q; want %q", tc.host, got, tc.def)
		}
		if got := blockedClass(t, dev.CheckHost(tc.host)); got != tc.dev {
			t.Errorf("allow 127.0.0.1/32: CheckHost(%q) blocked as %q; want %q", tc.host, got, tc.dev)
		}
	}
}

func TestCheckHostLocalhostEitherFamily(t *testing.T) {
	// localhost resolves to 127.0.0.1 and ::1: allowing one is enough early.
	g := mustNew(t, Config{AllowCIDRs: []string{"::1/128"}})
	if err := g.CheckHost("localhost"); err != nil {
		t.Errorf("allow ::1/128: CheckHost(localhost) = %v; want nil", err)
	}
}

func TestAllowHosts(t *testing.T) {
	g := mustNew(t, Config{AllowHosts: []string{"metadata.lab", "*.svc.cluster.local", "LocalHost."}})
	for _, tc := range []struct {
		host   string
		marked bool
		class  string
	}{
		{"metadata.lab", true, ""},
		{"METADATA.lab.", true, ""},
		{"x.metadata.lab", false, ""},
		{"db.svc.cluster.local", true, ""},
		{"a.b.svc.cluster.local", true, ""},
		{"DB.SVC.CLUSTER.LOCAL.", true, ""},
		{"svc.cluster.local", false, ""},
		{"xsvc.cluster.local", false, ""},
		{"localhost", true, ""},
		{"app.localhost", false, "loopback"},
		{"127.0.0.1", false, "loopback"}, // literals are never names
		{"example.com", false, ""},
	} {
		ctx, err := g.CheckHostContext(context.Background(), tc.host)
		if got := blockedClass(t, err); got != tc.class {
			t.Errorf("CheckHostContext(%q) blocked as %q; want %q", tc.host, got, tc.class)
		}
		if got := allowed(ctx); got != tc.marked {
			t.Errorf("CheckHostContext(%q) marked the context: %v; want %v", tc.host, got, tc.marked)
		}
		if got := blockedClass(t, g.CheckHost(tc.host)); got != tc.class {
			t.Errorf("CheckHost(%q) blocked as %q; want %q", tc.host, got, tc.class)
		}
		// The mark is what lets the dial of an allowed name reach a
		// private address.
		dialErr := g.Control(ctx, "tcp", "10.0.0.1:443", nil)
		if (dialErr == nil) != tc.marked {
			t.Errorf("Control after CheckHostContext(%q) = %v; want allowed=%v", tc.host, dialErr, tc.marked)
		}
	}
}

func TestControl(t *testing.T) {
	g := mustNew(t, Config{})
	ctx := context.Background()
	for _, tc := range []struct {
		network, address string
		class            string
	}{
		{"tcp", "127.0.0.1:80", "loopback"},
		{"tcp6", "[::1]:443", "loopback"},
		{"tcp4", "8.8.8.8:443", ""},
		{"tcp6", "[2606:4700:4700::1111]:443", ""},
		{"tcp6", "[::ffff:127.0.0.1]:80", "ipv4-mapped(loopback)"},
		{"tcp6", "[fe80::1%eth0]:80", "link-local"},
		{"tcp4", "169.254.169.254:80", "link-local"},
		{"udp", "10.0.0.53:53", "private"},
		{"tcp4", "0.0.0.0:8080", "unspecified"},
	} {
		// A nil RawConn: Control must decide on the address alone.
		if got := blockedClass(t, g.Control(ctx, tc.network, tc.address, nil)); got != tc.class {
			t.Errorf("Control(%s, %s) blocked as %q; want %q", tc.network, tc.address, got, tc.class)
		}
	}
	// Not an ip:port: fail closed, with a plain error.
	for _, addr := range []string{"/run/app.sock", "example.com:80", "127.0.0.1", ""} {
		err := g.Control(ctx, "unix", addr, nil)
		var be *BlockedError
		if err == nil || errors.As(err, &be) {
			t.Errorf("Control(%q) = %v; want a non-BlockedError error", addr, err)
		}
	}
}

func TestControlAllowedContext(t *testing.T) {
	g := mustNew(t, Config{})
	ctx, cancel := context.WithCancel(AllowedContext(context.Background()))
	defer cancel()
	for _, addr := range []string{"127.0.0.1:80", "[::1]:443", "8.8.8.8:443"} {
		if err := g.Control(ctx, "tcp", addr, nil); err != nil {
			t.Errorf("Control(marked, %s) = %v; want nil", addr, err)
		}
		if addr != "8.8.8.8:443" && g.Control(context.Background(), "tcp", addr, nil) == nil {
			t.Errorf("Control(unmarked, %s) = nil; want blocked", addr)
		}
	}
	var nilCtx context.Context
	if allowed(context.Background()) || allowed(nilCtx) {
		t.Error("an unmarked context counts as allowed")
	}
}

// TestBlockedErrorThroughOpError checks that the proxy can still find the
// *BlockedError once net.Dialer has wrapped it.
func TestBlockedErrorThroughOpError(t *testing.T) {
	g := mustNew(t, Config{})
	err := g.Control(context.Background(), "tcp", "169.254.169.254:80", nil)
	wrapped := &net.OpError{Op: "dial", Net: "tcp", Err: err}
	var be *BlockedError
	if !errors.As(wrapped, &be) {
		t.Fatalf("errors.As(%v) found no *BlockedError", wrapped)
	}
	if be.HTTPStatus() != 403 {
		t.Errorf("HTTPStatus() = %d; want 403", be.HTTPStatus())
	}
}

func TestBlockedErrorMessage(t *testing.T) {
	def := mustNew(t, Config{})
	for _, tc := range []struct {
		err  error
		want string
	}{
		{def.CheckIP(netip.MustParseAddr("169.254.169.254")),
			"refusing to connect to 169.254.169.254 (link-local: cloud metadata); allow it with guard.allow_cidrs"},
		{def.CheckIP(netip.MustParseAddr("fd00:ec2::254")),
			"refusing to connect to fd00:ec2::254 (private: cloud metadata); allow it with guard.allow_cidrs"},
		{def.CheckHost("[::ffff:a9fe:a9fe]"),
			"refusing to connect to [::ffff:a9fe:a9fe] = ::ffff:169.254.169.254 (ipv4-mapped(link-local): cloud metadata); allow it with guard.allow_cidrs"},
		{def.CheckHost("2130706433"),
			"refusing to connect to 2130706433 = 127.0.0.1 (loopback); allow it with guard.allow_cidrs"},
		{def.CheckHost("[::1]"),
			"refusing to connect to ::1 (loopback); allow it with guard.allow_cidrs"},
		{def.CheckHost("localhost"),
			"refusing to connect to localhost = 127.0.0.1 (loopback); allow it with guard.allow_cidrs or guard.allow_hosts"},
		{def.CheckIP(netip.MustParseAddr("0.0.0.0")),
			"refusing to connect to 0.0.0.0 (unspecified); this address is never allowed"},
		{def.CheckHost("256.1.1.1"),
			`refusing to connect to "256.1.1.1" (invalid-host); it is not a valid IPv4 address`},
		{def.CheckHost("a\nb"),
			`refusing to connect to "a\nb" (invalid-host); it is not a valid host name`},
		{def.CheckHost("fe80::1%\n"),
			`refusing to connect to "fe80::1%\n" = fe80::1 (link-local); allow it with guard.allow_cidrs`},
	} {
		if tc.err == nil {
			t.Errorf("want %q, got nil", tc.want)
			continue
		}
		if got := tc.err.Error(); got != tc.want {
			t.Errorf("Error() =\n  %s\nwant\n  %s", got, tc.want)
		}
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		c    Config
		want []string // substrings; none means valid
	}{
		{"zero", Config{}, nil},
		{"good", Config{
			AllowPrivate: true,
			AllowCIDRs:   []string{"127.0.0.1/32", "10.0.0.0/8", "fd00::/8", "::1", "192.168.1.10", "::ffff:10.0.0.0/104", "0.0.0.0/0"},
			AllowHosts:   []string{"db.lab", "*.internal.example", "localhost", "Metadata.Lab.", "_svc.lab"},
		}, nil},
		{"bad cidrs", Config{AllowCIDRs: []string{"127.0.0.1/32", "10.0.0.0/33", "nonsense", "10.1.2.3/8", "224.0.0.0/4", "fe80::1%eth0", " 10.0.0.0/8", "0.0.0.0/32", "ff02::/16", "::/128"}},
			[]string{
				`allow_cidrs[1]: invalid range "10.0.0.0/33"`,
				`allow_cidrs[2]: invalid range "nonsense"`,
				`allow_cidrs[3]: range "10.1.2.3/8" has bits set past the prefix length; did you mean "10.0.0.0/8"?`,
				`allow_cidrs[4]: range "224.0.0.0/4" is multicast, which is never allowed`,
				`allow_cidrs[5]: invalid range "fe80::1%eth0"`,
				`allow_cidrs[6]: invalid range " 10.0.0.0/8"`,
				`allow_cidrs[7]: range "0.0.0.0/32" is unspecified, which is never allowed`,
				`allow_cidrs[8]: range "ff02::/16" is multicast, which is never allowed`,
				`allow_cidrs[9]: range "::/128" is unspecified, which is never allowed`,
			}},
		{"bad hosts", Config{AllowHosts: []string{"ok.lab", "", "*", "http://x.lab", "x.lab:80", "127.0.0.1", "[::1]", "a.*.lab", "*.", "a b", "example.1", "*.1", "a..b", "*..lab"}},
			[]string{
				`allow_hosts[1]: empty host pattern`,
				`allow_hosts[2]: "*" would turn the guard off; use allow_private`,
				`allow_hosts[3]: "http://x.lab": want a bare host name`,
				`allow_hosts[4]: "x.lab:80": want a bare host name`,
				`allow_hosts[5]: "127.0.0.1" is an IP address; put it in allow_cidrs`,
				`allow_hosts[6]: "[::1]" is an IP address; put it in allow_cidrs`,
				`allow_hosts[7]: "a.*.lab" is not a host name`,
				`allow_hosts[8]: "*." is not a host name`,
				`allow_hosts[9]: "a b" is not a host name`,
				`allow_hosts[10]: "example.1" is neither a host name nor an IPv4 address`,
				`allow_hosts[11]: "*.1" is neither a host name nor an IPv4 address`,
				`allow_hosts[12]: "a..b" is not a host name`,
				`allow_hosts[13]: "*..lab" is not a host name`,
			}},
		{"both", Config{AllowCIDRs: []string{"x"}, AllowHosts: []string{""}},
			[]string{"allow_cidrs[0]: ", "allow_hosts[0]: "}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.c.Validate()
			_, newErr := New(tc.c)
			if len(tc.want) == 0 {
				if err != nil || newErr != nil {
					t.Fatalf("Validate() = %v, New() = %v; want both nil", err, newErr)
				}
				return
			}
			if err == nil || newErr == nil {
				t.Fatalf("Validate() = %v, New() = %v; want errors", err, newErr)
			}
			msg := err.Error()
			for _, w := range tc.want {
				if !strings.Contains(msg, w) {
					t.Errorf("Validate() = %s\nwant it to contain %q", msg, w)
				}
			}
			if n := strings.Count(msg, "\n") + 1; n != len(tc.want) {
				t.Errorf("Validate() reported %d problems; want %d:\n%s", n, len(tc.want), msg)
			}
		})
	}
}

func TestCheckIPAllocs(t *testing.T) {
	g := mustNew(t, Config{AllowCIDRs: []string{"10.1.0.0/16", "127.0.0.1/32", "fd00::/8"}})
	ips := []netip.Addr{
		netip.MustParseAddr("93.184.216.34"),
		netip.MustParseAddr("2606:4700:4700::1111"),
		netip.MustParseAddr("::ffff:127.0.0.1"),
		netip.MustParseAddr("10.1.2.3"),
		netip.MustParseAddr("fd00::1%eth0"),
	}
	if n := testing.AllocsPerRun(100, func() {
		for _, ip := range ips {
			if g.CheckIP(ip) != nil {
				panic(ip)
			}
		}
	}); n != 0 {
		t.Errorf("CheckIP allocates %v times when allowing; want 0", n)
	}
}
