package mitm

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

func TestLeafVerifies(t *testing.T) {
	a := newTestAuthority(t, Config{}, nil)
	tests := []struct {
		host     string
		verifyAs string // the DNSName a client checks
		wantDNS  []string
		wantIP   string
	}{
		{host: "example.test", verifyAs: "example.test", wantDNS: []string{"example.test"}},
		{host: "Example.TEST.", verifyAs: "example.test", wantDNS: []string{"example.test"}},
		{host: "a_b.example.test", verifyAs: "a_b.example.test", wantDNS: []string{"a_b.example.test"}},
		// IPv4 leaves name the address in 4 bytes and in 16 (ipv4SAN).
		{host: "127.0.0.1", verifyAs: "127.0.0.1", wantIP: "127.0.0.1 127.0.0.1"},
		{host: "::1", verifyAs: "::1", wantIP: "::1"},
		{host: "[::1]", verifyAs: "::1", wantIP: "::1"},
		{host: "::ffff:127.0.0.1", verifyAs: "127.0.0.1", wantIP: "127.0.0.1 127.0.0.1"},
		{host: "fe80::1%eth0", verifyAs: "fe80::1", wantIP: "fe80::1"},
		{host: strings.Repeat("a", 63) + ".example.test", verifyAs: strings.Repeat("a", 63) + ".example.test",
			wantDNS: []string{strings.Repeat("a", 63) + ".example.test"}},
	}
	for _, tt := range tests {
		t.Run(tt.host, func(t *testing.T) {
			cert, err := a.Leaf(t.Context(), tt.host)
			if err != nil {
				t.Fatalf("Leaf(%q): %v", tt.host, err)
			}
			leaf := cert.Leaf
			if leaf == nil {
				t.Fatal("tls.Certificate.Leaf is nil")
			}
			if len(cert.Certificate) != 2 || !bytes.Equal(cert.Certificate[0], leaf.Raw) ||
				!bytes.Equal(cert.Certificate[1], a.Certificate().Raw) {
				t.Errorf("chain is not [leaf, CA]")
			}
			if _, err := leaf.Verify(x509.VerifyOptions{
				DNSName:   tt.verifyAs,
				Roots:     caPool(a),
				KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
			}); err != nil {
				t.Errorf("Verify(%q): %v", tt.verifyAs, err)
			}
			if !slices.Equal(leaf.DNSNames, tt.wantDNS) {
				t.Errorf("DNSNames = %q, want %q", leaf.DNSNames, tt.wantDNS)
			}
			var ips []string
			for _, ip := range leaf.IPAddresses {
				ips = append(ips, ip.String())
			}
			if tt.wantIP != "" && !slices.Equal(ips, strings.Fields(tt.wantIP)) || tt.wantIP == "" && len(ips) != 0 {
				t.Errorf("IPAddresses = %q, want [%s]", ips, tt.wantIP)
			}
			if leaf.Subject.CommonName != tt.verifyAs && len(tt.verifyAs) <= 64 {
				t.Errorf("CN = %q, want %q", leaf.Subject.CommonName, tt.verifyAs)
			}
		})
	}
}

func TestLeafFields(t *testing.T) {
	clk := newFakeClock(time.Now().Truncate(time.Second))
	a := newTestAuthority(t, Config{LeafValidity: 48 * time.Hour}, clk.Now)
	c1, err := a.Leaf(t.Context(), "one.test")
	if err != nil {
		t.Fatal(err)
	}
	c2, err := a.Leaf(t.Context(), "two.test")
	if err != nil {
		t.Fatal(err)
	}
	leaf := c1.Leaf

	if got, want := leaf.NotBefore, clk.Now().Add(-time.Hour); !got.Equal(want) {
		t.Errorf("NotBefore = %v, want %v", got, want)
	}
	if got, want := leaf.NotAfter, clk.Now().Add(48*time.Hour); !got.Equal(want) {
		t.Errorf("NotAfter = %v, want %v", got, want)
	}
	if leaf.KeyUsage != x509.KeyUsageDigitalSignature {
		t.Errorf("KeyUsage = %b, want DigitalSignature only", leaf.KeyUsage)
	}
	if !slices.Equal(leaf.ExtKeyUsage, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}) {
		t.Errorf("ExtKeyUsage = %v, want [ServerAuth]", leaf.ExtKeyUsage)
	}
	if leaf.IsCA {
		t.Error("leaf is a CA")
	}
	if leaf.SerialNumber.Sign() <= 0 || leaf.SerialNumber.BitLen() > 128 {
		t.Errorf("serial %x: want positive and at most 128 bits", leaf.SerialNumber)
	}
	if leaf.SerialNumber.Cmp(c2.Leaf.SerialNumber) == 0 {
		t.Error("two leaves share a serial number")
	}
	if !bytes.Equal(leaf.AuthorityKeyId, a.Certificate().SubjectKeyId) {
		t.Error("AuthorityKeyId does not name the CA")
	}
	pub, ok := leaf.PublicKey.(*ecdsa.PublicKey)
	if !ok || pub.Curve != elliptic.P256() {
		t.Fatalf("leaf key = %T, want ECDSA P-256", leaf.PublicKey)
	}
	if !pub.Equal(c2.Leaf.PublicKey) || c1.PrivateKey != c2.PrivateKey {
		t.Error("leaves do not share the one leaf key")
	}
}

func TestNormalizeHost(t *testing.T) {
	valid := []struct{ in, want string }{
		{"example.test", "example.test"},
		{"EXAMPLE.Test", "example.test"},
		{"example.test.", "example.test"},
		{"10.0.0.1", "10.0.0.1"},
		{"10.0.0.1.", "10.0.0.1"},
		{"[2001:DB8::1]", "2001:db8::1"},
		{"::ffff:10.0.0.1", "10.0.0.1"},
		{"fe80::1%eth0", "fe80::1"},
		{"1.2.3", "1.2.3"}, // not an IP, so a (numeric) name
		{"xn--bcher-kva.example", "xn--bcher-kva.example"},
		{strings.Repeat("a.", 126) + "a", strings.Repeat("a.", 126) + "a"}, // 253 characters
	}
	for _, tt := range valid {
		got, err := normalizeHost(tt.in)
		if err != nil || got != tt.want {
			t.Errorf("normalizeHost(%q) = %q, %v; want %q, nil", tt.in, got, err, tt.want)
		}
	}

	invalid := []struct{ in, want string }{
		{"", "empty host"},
		{".", "empty host"},
		{"a/b", "'/'"},
		{"example.test/path", "'/'"},
		{"a b", "space"},
		{" example.test", "space"},
		{"a\x00b", "control character"},
		{"a\tb", "control character"},
		{"a\nb", "control character"},
		{"a\x7fb", "control character"},
		{"example.test:443", "':'"},
		{"bücher.example", "punycode"},
		{"*.example.test", `'*'`},
		{"a..b", "empty label"},
		{".example.test", "empty label"},
		{strings.Repeat("a", 64) + ".test", "label of 64"},
		{strings.Repeat("a.", 127) + "a", "more than 253"},
		{"[]", "'['"},
	}
	for _, tt := range invalid {
		got, err := normalizeHost(tt.in)
		if err == nil {
			t.Errorf("normalizeHost(%q) = %q, nil; want an error", tt.in, got)
			continue
		}
		if !strings.Contains(err.Error(), tt.want) {
			t.Errorf("normalizeHost(%q) error %q lacks %q", tt.in, err, tt.want)
		}
	}
}

func TestLeafRejectsInvalidHost(t *testing.T) {
	a := newTestAuthority(t, Config{}, nil)
	for _, host := range []string{"", "a/b", "a b", "a\x01b", strings.Repeat("a", 254), "host:443"} {
		cert, err := a.Leaf(t.Context(), host)
		if err == nil {
			t.Errorf("Leaf(%q) = %v, want an error", host, cert.Leaf.DNSNames)
			continue
		}
		if !strings.HasPrefix(err.Error(), "mitm: leaf for ") {
			t.Errorf("Leaf(%q) error %q lacks the mitm prefix", host, err)
		}
	}
	if got := a.Stats().Mints; got != 0 {
		t.Errorf("Mints = %d after invalid hosts only, want 0", got)
	}
}

func TestHandshake(t *testing.T) {
	a := newTestAuthority(t, Config{}, nil)

	t.Run("sni wins over the connect host", func(t *testing.T) {
		state, err := handshake(t, a.ServerConfig("fallback.test:443"), &tls.Config{
			RootCAs:    caPool(a),
			ServerName: "sni.test",
		})
		if err != nil {
			t.Fatalf("handshake: %v", err)
		}
		if got := state.PeerCertificates[0].DNSNames; !slices.Equal(got, []string{"sni.test"}) {
			t.Errorf("peer DNSNames = %q, want [sni.test]", got)
		}
		if len(state.PeerCertificates) != 2 || !state.PeerCertificates[1].Equal(a.Certificate()) {
			t.Error("served chain is not [leaf, CA]")
		}
	})

	t.Run("no sni falls back to the connect host", func(t *testing.T) {
		// An empty ServerName makes the client send no SNI, as it does for IP literals.
		state, err := handshake(t, a.ServerConfig("fallback.test:443"), &tls.Config{InsecureSkipVerify: true})
		if err != nil {
			t.Fatalf("handshake: %v", err)
		}
		leaf := state.PeerCertificates[0]
		if _, err := leaf.Verify(x509.VerifyOptions{DNSName: "fallback.test", Roots: caPool(a)}); err != nil {
			t.Errorf("fallback leaf does not verify for fallback.test: %v", err)
		}
	})

	t.Run("tls 1.1 is refused", func(t *testing.T) {
		_, err := handshake(t, a.ServerConfig(""), &tls.Config{
			RootCAs:    caPool(a),
			ServerName: "old.test",
			MaxVersion: tls.VersionTLS11,
		})
		if err == nil {
			t.Fatal("handshake with TLS 1.1 succeeded")
		}
	})
}

func TestServerConfig(t *testing.T) {
	a := newTestAuthority(t, Config{}, nil)
	if cfg := a.ServerConfig("x.test"); cfg.MinVersion != tls.VersionTLS12 || cfg.NextProtos != nil {
		t.Errorf("MinVersion = %x, NextProtos = %q; want TLS 1.2 and none", cfg.MinVersion, cfg.NextProtos)
	}
	tests := []struct {
		fallback, sni string
		wantDNS       []string
		wantIP        net.IP
	}{
		{fallback: "fallback.test:443", wantDNS: []string{"fallback.test"}},
		{fallback: "fallback.test", wantDNS: []string{"fallback.test"}},
		{fallback: "Fallback.Test.:8443", wantDNS: []string{"fallback.test"}},
		{fallback: "[::1]:443", wantIP: net.ParseIP("::1")},
		{fallback: "[::1]", wantIP: net.ParseIP("::1")},
		{fallback: "::1", wantIP: net.ParseIP("::1")},
		{fallback: "127.0.0.1:443", wantIP: net.ParseIP("127.0.0.1").To4()},
		{fallback: "", sni: "only-sni.test", wantDNS: []string{"only-sni.test"}},
	}
	for _, tt := range tests {
		cert, err := a.ServerConfig(tt.fallback).GetCertificate(&tls.ClientHelloInfo{ServerName: tt.sni})
		if err != nil {
			t.Errorf("ServerConfig(%q) with SNI %q: %v", tt.fallback, tt.sni, err)
			continue
		}
		if !slices.Equal(cert.Leaf.DNSNames, tt.wantDNS) {
			t.Errorf("ServerConfig(%q): DNSNames = %q, want %q", tt.fallback, cert.Leaf.DNSNames, tt.wantDNS)
		}
		if tt.wantIP != nil && (len(cert.Leaf.IPAddresses) == 0 || !cert.Leaf.IPAddresses[0].Equal(tt.wantIP)) {
			t.Errorf("ServerConfig(%q): IPAddresses = %v, want [%v]", tt.fallback, cert.Leaf.IPAddresses, tt.wantIP)
		}
	}

	if _, err := a.ServerConfig("").GetCertificate(&tls.ClientHelloInfo{}); err == nil ||
		!strings.Contains(err.Error(), "no sni") {
		t.Errorf("no SNI and no fallback: err = %v, want a no-sni error", err)
	}
}

func TestLeafMintsOnceUnderConcurrency(t *testing.T) {
	a := newTestAuthority(t, Config{}, nil)
	const n = 500
	var (
		wg    sync.WaitGroup
		start = make(chan struct{})
		certs = make([]*tls.Certificate, n)
		errs  = make([]error, n)
	)
	for i := range n {
		wg.Go(func() {
			<-start // release all at once so the calls overlap
			certs[i], errs[i] = a.Leaf(t.Context(), "burst.test")
		})
	}
	close(start)
	wg.Wait()

	for i := range n {
		if errs[i] != nil {
			t.Fatalf("call %d: %v", i, errs[i])
		}
		if certs[i] != certs[0] {
			t.Fatalf("call %d returned a different certificate than call 0", i)
		}
	}
	if got := a.Stats().Mints; got != 1 {
		t.Errorf("Mints = %d after %d concurrent calls for one host, want 1", got, n)
	}
}

func TestCacheBound(t *testing.T) {
	a := newTestAuthority(t, Config{CacheSize: 10}, nil)
	for i := range 100 {
		if _, err := a.Leaf(t.Context(), fmt.Sprintf("h%d.test", i)); err != nil {
			t.Fatal(err)
		}
	}
	a.cache.CleanUp()
	st := a.Stats()
	if st.Cached > 10 {
		t.Errorf("Cached = %d, want at most 10", st.Cached)
	}
	if st.Mints != 100 {
		t.Errorf("Mints = %d, want 100", st.Mints)
	}
}

func TestLeafReMintedAfterHalfLife(t *testing.T) {
	clk := newFakeClock(time.Now())
	a := newTestAuthority(t, Config{LeafValidity: 168 * time.Hour}, clk.Now)

	first, err := a.Leaf(t.Context(), "expiry.test")
	if err != nil {
		t.Fatal(err)
	}
	clk.Advance(83 * time.Hour) // just short of half of 168h
	again, err := a.Leaf(t.Context(), "expiry.test")
	if err != nil {
		t.Fatal(err)
	}
	if again != first || a.Stats().Mints != 1 {
		t.Fatalf("re-minted before half the lifetime: Mints = %d", a.Stats().Mints)
	}

	clk.Advance(2 * time.Hour) // 85h: past half
	fresh, err := a.Leaf(t.Context(), "expiry.test")
	if err != nil {
		t.Fatal(err)
	}
	if got := a.Stats().Mints; got != 2 {
		t.Fatalf("Mints = %d after half the lifetime, want 2", got)
	}
	if fresh == first || !fresh.Leaf.NotAfter.After(first.Leaf.NotAfter) {
		t.Errorf("re-minted leaf is not newer: NotAfter %v, was %v", fresh.Leaf.NotAfter, first.Leaf.NotAfter)
	}
}

func TestLeafClampedToCA(t *testing.T) {
	dir := t.TempDir()
	createCA(t, dir)
	probe := newTestAuthority(t, Config{CADir: dir}, nil)
	caNotAfter := probe.Certificate().NotAfter

	clk := newFakeClock(caNotAfter.Add(-24 * time.Hour))
	a := newTestAuthority(t, Config{CADir: dir, LeafValidity: 168 * time.Hour}, clk.Now)
	cert, err := a.Leaf(t.Context(), "late.test")
	if err != nil {
		t.Fatal(err)
	}
	if !cert.Leaf.NotAfter.Equal(caNotAfter) {
		t.Errorf("leaf NotAfter = %v, want the CA's %v", cert.Leaf.NotAfter, caNotAfter)
	}
	if _, err := cert.Leaf.Verify(x509.VerifyOptions{
		DNSName: "late.test", Roots: caPool(a), CurrentTime: clk.Now(),
	}); err != nil {
		t.Errorf("Verify: %v", err)
	}
}

// When the CA is close to expiry a leaf's cache lifetime is short, and the 1h freshness check must replace a
// cached leaf the cache itself still considers live.
func TestLeafFreshnessCheck(t *testing.T) {
	dir := t.TempDir()
	createCA(t, dir)
	caNotAfter := newTestAuthority(t, Config{CADir: dir}, nil).Certificate().NotAfter

	clk := newFakeClock(caNotAfter.Add(-90 * time.Minute))
	a := newTestAuthority(t, Config{CADir: dir}, clk.Now)
	first, err := a.Leaf(t.Context(), "fresh.test") // 90m of validity, cached for 45m
	if err != nil {
		t.Fatal(err)
	}
	clk.Advance(40 * time.Minute) // 50m left: still cached, no longer fresh
	second, err := a.Leaf(t.Context(), "fresh.test")
	if err != nil {
		t.Fatal(err)
	}
	if second == first || a.Stats().Mints != 2 {
		t.Errorf("a leaf with 50m left was served from cache (Mints = %d)", a.Stats().Mints)
	}

	clk.Advance(time.Hour) // CA expired
	if _, err := a.Leaf(t.Context(), "other.test"); err == nil || !strings.Contains(err.Error(), "expired") {
		t.Errorf("Leaf after the CA expired: err = %v, want an expiry error", err)
	}
}

func TestCloseIdempotent(t *testing.T) {
	a := newTestAuthority(t, Config{}, nil)
	a.Close()
	a.Close()
	if _, err := a.Leaf(t.Context(), "after-close.test"); err != nil {
		t.Errorf("Leaf after Close: %v", err)
	}
}

func TestCloseStopsGoroutines(t *testing.T) {
	before := runtime.NumGoroutine()
	a, err := LoadOrCreate(Config{CADir: t.TempDir()}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		if _, err := a.Leaf(t.Context(), fmt.Sprintf("g%d.test", i)); err != nil {
			t.Fatal(err)
		}
	}
	a.Close()
	// Maintenance tasks that otter hands to its executor finish on their own; give them a moment.
	if !testkit.Poll(testkit.Patience, func() bool { return runtime.NumGoroutine() <= before }) {
		t.Fatalf("%d goroutines after Close, %d before LoadOrCreate", runtime.NumGoroutine(), before)
	}
}

// TestShortLeafValidityIsCached: with the shortest leaf_validity Config accepts (1h), a leaf is served from the cache
// until its half-life like any other. The freshness check used to demand an hour left, more than a 1h leaf ever
// has a moment after minting, so every handshake signed twice and the cache never served.
func TestShortLeafValidityIsCached(t *testing.T) {
	clk := newFakeClock(time.Now())
	a := newTestAuthority(t, Config{LeafValidity: time.Hour}, clk.Now)

	first, err := a.Leaf(t.Context(), "short.test")
	if err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Minute)
	again, err := a.Leaf(t.Context(), "short.test")
	if err != nil {
		t.Fatal(err)
	}
	if again != first || a.Stats().Mints != 1 {
		t.Fatalf("a 1h leaf was re-minted after a minute: Mints = %d", a.Stats().Mints)
	}

	clk.Advance(30 * time.Minute) // 31m: past half of 1h
	fresh, err := a.Leaf(t.Context(), "short.test")
	if err != nil {
		t.Fatal(err)
	}
	if fresh == first || a.Stats().Mints != 2 {
		t.Errorf("Mints = %d past the half-life of a 1h leaf, want 2", a.Stats().Mints)
	}
}
