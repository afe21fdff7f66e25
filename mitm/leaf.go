package mitm

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/maypok86/otter/v2"
)

// minRemaining is the validity a cached leaf must still have to be served. The cache already drops a leaf at half
// its lifetime, so this only matters if the clock jumps or the CA is about to expire; a client whose clock is a
// little ahead of ours would otherwise reject a leaf in its last minutes.
const minRemaining = time.Hour

// maxCommonNameLen is the RFC 5280 upper bound (ub-common-name). Longer names go only into the SAN, which is
// what clients check anyway.
const maxCommonNameLen = 64

// Leaf returns the certificate for host (a DNS name or an IP literal, no port), minting it at most once per host
// while cached. The chain is [leaf, CA] and tls.Certificate.Leaf is set. The returned certificate is shared: do not modify
// it.
func (a *Authority) Leaf(ctx context.Context, host string) (*tls.Certificate, error) {
	key, err := normalizeHost(host)
	if err != nil {
		return nil, fmt.Errorf("mitm: leaf for %q: %w", host, err)
	}
	// Get deduplicates concurrent loads of one key: a burst of handshakes for a new host signs once.
	cert, err := a.cache.Get(ctx, key, a.loader)
	if err != nil {
		return nil, fmt.Errorf("mitm: leaf for %q: %w", key, err)
	}
	// A leaf shorter-lived than 2*minRemaining never has minRemaining left (its NotAfter is even cut to the
	// second when encoded), so demanding it would re-mint on every call; for those, ask for less than the
	// half-life at which the cache replaces the leaf anyway: a quarter of the validity.
	// A leaf not valid yet is stale too: the clock stepped back since it
	// was minted (NTP correcting a clock that ran ahead, a VM restored),
	// and every client would reject it until the clock caught up.
	now := a.now()
	if !now.Before(cert.Leaf.NotBefore) && cert.Leaf.NotAfter.Sub(now) >= min(minRemaining, a.cfg.LeafValidity/4) {
		return cert, nil
	}
	// Drop exactly the stale value: a plain Invalidate could also remove a fresh leaf that a concurrent caller
	// has just minted, and then that caller's waiters would mint again.
	a.cache.ComputeIfPresent(key, func(old *tls.Certificate) (*tls.Certificate, otter.ComputeOp) {
		if old == cert {
			return nil, otter.InvalidateOp
		}
		return old, otter.CancelOp
	})
	// No second freshness check: if the CA itself expires within minRemaining, no leaf can pass it, and serving
	// the freshly minted, short-lived one is better than failing the handshake.
	cert, err = a.cache.Get(ctx, key, a.loader)
	if err != nil {
		return nil, fmt.Errorf("mitm: leaf for %q: %w", key, err)
	}
	return cert, nil
}

// ServerConfig returns a *tls.Config for the server side of an intercepted connection. Its GetCertificate signs
// for the client's SNI, and for fallbackHost (a CONNECT host; a port is allowed and stripped) when the client sent
// no SNI, as clients do when they connect to an IP literal. SNI wins over the CONNECT host because a client that
// resolved the name itself (socks5:// rather than socks5h://) CONNECTs to an IP but verifies the name.
// NextProtos is left empty for the caller to set ALPN.
func (a *Authority) ServerConfig(fallbackHost string) *tls.Config {
	fallback := fallbackHost
	if h, _, err := net.SplitHostPort(fallbackHost); err == nil {
		fallback = h
	}
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		GetCertificate: func(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
			host := hello.ServerName
			if host == "" {
				host = fallback
			}
			if host == "" {
				return nil, errors.New("mitm: client sent no sni and there is no fallback host")
			}
			// A ClientHelloInfo built outside a handshake (as in tests) has no context.
			ctx := hello.Context()
			if ctx == nil {
				ctx = context.Background()
			}
			return a.Leaf(ctx, host)
		},
	}
}

// initCache builds the leaf cache. Each entry lives for half of its leaf's remaining lifetime, so a host that
// stays busy gets a new leaf well before clients could see the old one expire.
func (a *Authority) initCache() error {
	a.clock = &cacheClock{now: a.now}
	a.loader = otter.LoaderFunc[string, *tls.Certificate](a.mint)
	cache, err := otter.New(&otter.Options[string, *tls.Certificate]{
		MaximumSize: a.cfg.CacheSize,
		ExpiryCalculator: otter.ExpiryCreatingFunc(func(e otter.Entry[string, *tls.Certificate]) time.Duration {
			return max(e.Value.Leaf.NotAfter.Sub(a.now())/2, time.Second)
		}),
		Clock: a.clock,
	})
	if err != nil {
		return fmt.Errorf("mitm: create leaf cache: %w", err)
	}
	a.cache = cache
	return nil
}

// mint signs a leaf for key, a host already normalized by normalizeHost. It is the cache's loader.
func (a *Authority) mint(ctx context.Context, key string) (*tls.Certificate, error) {
	now := a.now()
	if !now.Before(a.caCert.NotAfter) {
		return nil, fmt.Errorf("ca certificate expired at %s; %s",
			a.caCert.NotAfter.UTC().Format(time.RFC3339), a.regenHint())
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	// A leaf outliving its issuer would be rejected by clients anyway; clamping keeps our cache TTL honest.
	notAfter := now.Add(a.cfg.LeafValidity)
	if notAfter.After(a.caCert.NotAfter) {
		notAfter = a.caCert.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		// An hour of slack for clients whose clock is behind ours.
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
	}
	if len(key) <= maxCommonNameLen {
		tmpl.Subject = pkix.Name{CommonName: key}
	}
	if addr, err := netip.ParseAddr(key); err == nil && addr.Is4() {
		san, err := ipv4SAN(addr)
		if err != nil {
			return nil, fmt.Errorf("sign leaf: %w", err)
		}
		tmpl.ExtraExtensions = []pkix.Extension{san}
	} else if err == nil {
		tmpl.IPAddresses = []net.IP{addr.AsSlice()}
	} else {
		tmpl.DNSNames = []string{key}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, a.caCert, &a.leafKey.PublicKey, a.caKey)
	if err != nil {
		return nil, fmt.Errorf("sign leaf: %w", err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parse leaf: %w", err)
	}
	a.mints.Add(1)
	if a.logger.Enabled(ctx, slog.LevelDebug) {
		a.logger.DebugContext(ctx, "minted leaf certificate", "host", key, "not_after", notAfter)
	}
	return &tls.Certificate{
		Certificate: [][]byte{der, a.caCert.Raw},
		PrivateKey:  a.leafKey,
		Leaf:        leaf,
	}, nil
}

// oidSubjectAltName is the subjectAltName extension (RFC 5280 §4.2.1.6).
var oidSubjectAltName = asn1.ObjectIdentifier{2, 5, 29, 17}

// ipv4SAN is the subjectAltName of an IPv4 leaf: the address in 4 bytes
// and as IPv4-mapped IPv6 in 16. A client that dialed [::ffff:a.b.c.d]
// (normalizeHost gives both one leaf) is checked by OpenSSL, and so by
// curl and Python, against the 16 bytes; x509.CreateCertificate writes
// any IPv4 address in 4, hence the extension made here.
func ipv4SAN(addr netip.Addr) (pkix.Extension, error) {
	v4, v6 := addr.As4(), addr.As16()
	value, err := asn1.Marshal([]asn1.RawValue{
		{Class: asn1.ClassContextSpecific, Tag: 7, Bytes: v4[:]}, // iPAddress
		{Class: asn1.ClassContextSpecific, Tag: 7, Bytes: v6[:]},
	})
	if err != nil {
		return pkix.Extension{}, fmt.Errorf("encode subjectAltName: %w", err)
	}
	return pkix.Extension{Id: oidSubjectAltName, Value: value}, nil
}

// normalizeHost returns the cache key for host: the canonical form of an IP literal (brackets and zone dropped,
// IPv4-mapped IPv6 unmapped), or a lower-cased DNS name without its trailing dot. Names are checked against the
// characters that can appear in a hostname, so that nothing odd (a path, a port, a control character) ever ends
// up in a certificate that clients trust.
func normalizeHost(host string) (string, error) {
	// The trailing dot of a fully qualified name goes first, so that "10.0.0.1." is taken for the IP it names
	// rather than minted as a DNS name no client would match.
	host = strings.TrimSuffix(host, ".")
	if host == "" {
		return "", errors.New("empty host")
	}
	if len(host) > 2 && host[0] == '[' && host[len(host)-1] == ']' {
		host = host[1 : len(host)-1]
	}
	// Only strings that could be IP literals are parsed: a failed ParseAddr allocates its error, and names are
	// the common case on the hot path.
	if strings.IndexByte(host, ':') >= 0 || isDigit(host[len(host)-1]) {
		if addr, err := netip.ParseAddr(host); err == nil {
			return addr.WithZone("").Unmap().String(), nil
		}
	}
	for i := 0; i < len(host); i++ {
		c := host[i]
		switch {
		case c < 0x20 || c == 0x7f:
			return "", fmt.Errorf("host contains control character %#02x", c)
		case c == ' ':
			return "", errors.New("host contains a space")
		case c == '/':
			return "", errors.New("host contains '/'")
		case c == ':':
			return "", errors.New("host contains ':' but is not an IP literal (pass the host without a port)")
		case c >= 0x80:
			return "", errors.New("host is not ASCII: use its punycode (IDNA) form")
		case !isHostChar(c):
			return "", fmt.Errorf("host contains %q", c)
		}
	}
	host = strings.ToLower(host)
	if len(host) > 253 {
		return "", fmt.Errorf("host is %d characters long, more than 253", len(host))
	}
	for label := range strings.SplitSeq(host, ".") {
		if label == "" {
			return "", errors.New("host has an empty label")
		}
		if len(label) > 63 {
			return "", fmt.Errorf("host has a label of %d characters, more than 63", len(label))
		}
	}
	return host, nil
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }

// isHostChar allows letters, digits, '-', '.', and '_', which is not valid in hostnames but common in real DNS
// names (service records, some CDNs), and clients accept it in certificates.
func isHostChar(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || isDigit(c) || c == '-' || c == '.' || c == '_'
}

// cacheClock drives otter's expiry from Authority.now, the clock that also decides certificate validity, so the
// two never disagree and tests can move both at once. It reads wall time: a certificate's validity is wall time.
type cacheClock struct {
	now func() time.Time

	mu      sync.Mutex // protects ticker and stopped
	ticker  *time.Ticker
	stopped bool
}

func (c *cacheClock) NowNano() int64 { return c.now().UnixNano() }

// Tick serves otter's periodic clean-up. otter cannot stop the ticks of a custom clock, so the clock owns its
// ticker and Authority.Close stops it.
func (c *cacheClock) Tick(d time.Duration) <-chan time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return nil // no ticks: otter then does without periodic clean-ups
	}
	if c.ticker == nil {
		c.ticker = time.NewTicker(d)
	}
	return c.ticker.C
}

func (c *cacheClock) stop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stopped = true
	if c.ticker != nil {
		c.ticker.Stop()
	}
}
