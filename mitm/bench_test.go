package mitm

import (
	"context"
	"crypto/tls"
	"net"
	"strconv"
	"testing"
)

// BenchmarkLeafMint measures a cache miss: normalization, one CA signature and the parse of the new leaf.
func BenchmarkLeafMint(b *testing.B) {
	a := newTestAuthority(b, Config{}, nil)
	ctx := context.Background()
	hosts := make([]string, b.N)
	for i := range hosts {
		hosts[i] = "h" + strconv.Itoa(i) + ".bench.test"
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := a.Leaf(ctx, hosts[i]); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLeafCached measures the hit path that every intercepted handshake for a known host takes.
func BenchmarkLeafCached(b *testing.B) {
	a := newTestAuthority(b, Config{}, nil)
	ctx := context.Background()
	if _, err := a.Leaf(ctx, "cached.bench.test"); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := a.Leaf(ctx, "cached.bench.test"); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkHandshake measures a full TLS handshake (no resumption) served with a cached leaf, client verifying
// the chain, over net.Pipe so the network is out of the picture.
func BenchmarkHandshake(b *testing.B) {
	a := newTestAuthority(b, Config{}, nil)
	if _, err := a.Leaf(context.Background(), "hs.bench.test"); err != nil {
		b.Fatal(err)
	}
	serverCfg := a.ServerConfig("")
	clientCfg := &tls.Config{RootCAs: caPool(a), ServerName: "hs.bench.test"}
	b.ReportAllocs()
	for b.Loop() {
		c, s := net.Pipe()
		serverErr := make(chan error, 1)
		go func() {
			serverErr <- tls.Server(s, serverCfg).Handshake()
		}()
		if err := tls.Client(c, clientCfg).Handshake(); err != nil {
			b.Fatal(err)
		}
		if err := <-serverErr; err != nil {
			b.Fatal(err)
		}
		_ = c.Close()
		_ = s.Close()
	}
}
