package mirror

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"math/big"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/capture"
)

// curveOrigin is a TLS origin that accepts only the given groups (a
// FIPS-configured server: NIST curves only) and keeps the hellos it got.
type curveOrigin struct {
	ln     net.Listener
	wg     sync.WaitGroup
	mu     sync.Mutex
	hellos []*fingerprint.ClientHello
}

func startCurveOrigin(t *testing.T, curves ...tls.CurveID) *curveOrigin {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(time.Hour), DNSNames: []string{"localhost"}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}, CurvePreferences: curves}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	o := &curveOrigin{ln: ln}
	t.Cleanup(func() { ln.Close(); o.wg.Wait() })
	o.wg.Add(1)
	go func() {
		defer o.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			o.wg.Add(1)
			go func() {
				defer o.wg.Done()
				defer c.Close()
				c.SetDeadline(time.Now().Add(5 * time.Second))
				rc, h, err := capture.PeekClientHello(c)
				if err != nil {
					return
				}
				o.mu.Lock()
				o.hellos = append(o.hellos, h)
				o.mu.Unlock()
				tc := tls.Server(rc, cfg)
				if tc.Handshake() == nil {
					tc.Read(make([]byte, 1)) // until the client closes
				}
			}()
		}
	}()
	return o
}

// TestSecondClassicalKeyShare: Firefox sends key shares for X25519
// and P-256. An origin that only does P-256 takes the P-256 share, as it
// does from Firefox itself; utls keeps a private key for the first
// classical share only, so the mirrored handshake fails ("invalid server
// key share") on the client's side, the origin having refused nothing.
// The origin must still get the client's hello (the private key on the
// share it picks), not the closest one (without delegated_credentials and
// record_size_limit: another JA4), and the next dial must go straight
// there.
func TestSecondClassicalKeyShare(t *testing.T) {
	o := startCurveOrigin(t, tls.CurveP256)
	hello := firefoxHello(t)
	if !slices.Equal(hello.KeyShareGroups, []uint16{0x1d, 0x17}) {
		t.Fatalf("firefox parrot key shares %x", hello.KeyShareGroups)
	}
	var cd countingDialer
	d := &Dialer{Dial: cd.dial, TLSConfig: &tls.Config{InsecureSkipVerify: true, ServerName: "localhost"}}
	for i := range 2 {
		before := cd.n.Load()
		c, err := d.DialTLS(ctxTimeout(t, 10*time.Second), "tcp", o.ln.Addr().String(), hello)
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
		if r := c.Report(); r.Mode != Mirrored || len(r.Changes) != 0 {
			t.Errorf("dial %d: report %+v", i, r)
		}
		if i == 1 && cd.n.Load()-before != 1 {
			t.Errorf("dial %d took %d connections", i, cd.n.Load()-before)
		}
		o.mu.Lock()
		got := o.hellos[len(o.hellos)-1]
		o.mu.Unlock()
		if got.JA4() != hello.JA4() || !slices.Equal(extTypes(got), extTypes(hello)) ||
			!slices.Equal(got.KeyShareGroups, hello.KeyShareGroups) || len(got.Raw) != len(hello.Raw) {
			t.Errorf("dial %d: origin saw %s %x shares %x (%d bytes); client's %s %x %x (%d bytes)", i,
				got.JA4(), extTypes(got), got.KeyShareGroups, len(got.Raw), hello.JA4(), extTypes(hello), hello.KeyShareGroups, len(hello.Raw))
		}
	}
}
