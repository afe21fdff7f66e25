package mitm

import (
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestLeafAfterClockStepBack: the wall clock steps back (NTP correcting a clock that was ahead, a VM restored
// from a snapshot, a laptop whose RTC was wrong). A leaf minted before the step has a NotBefore in the new
// "future", and the cache's expiry is on the same wall clock: Leaf mints a new one instead of serving, for its
// whole half-life (84h by default), a leaf every client rejects.
func TestLeafAfterClockStepBack(t *testing.T) {
	clk := newFakeClock(time.Now())
	a := newTestAuthority(t, Config{}, clk.Now)
	clk.Advance(5 * time.Hour) // the CA stays valid through the step below: it was made long before
	if _, err := a.Leaf(t.Context(), "skew.test"); err != nil {
		t.Fatal(err)
	}
	clk.Advance(-3 * time.Hour) // the clock was 3h ahead; NTP fixes it
	cert, err := a.Leaf(t.Context(), "skew.test")
	if err != nil {
		t.Fatal(err)
	}
	now := clk.Now()
	if now.Before(cert.Leaf.NotBefore) {
		t.Errorf("served a leaf that is not valid yet: NotBefore %v is %v after now (Mints = %d)",
			cert.Leaf.NotBefore, cert.Leaf.NotBefore.Sub(now), a.Stats().Mints)
	}
	if _, err := cert.Leaf.Verify(x509.VerifyOptions{
		DNSName: "skew.test", Roots: caPool(a), CurrentTime: now,
	}); err != nil {
		t.Errorf("a client with the corrected clock rejects the served leaf: %v", err)
	}
}

// TestForeignCAWithoutServerAuthEKU: a bring-your-own CA restricted to clientAuth (a common corporate or VPN CA)
// signs leaves that every client rejects (EKU nests down the chain in Go, Chrome, OpenSSL). Start-up fails with an
// error naming ca.pem, instead of loading it without a word.
func TestForeignCAWithoutServerAuthEKU(t *testing.T) {
	dir := t.TempDir()
	key := mustECKey(t)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(7),
		Subject:               pkix.Name{CommonName: "client-auth only CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().AddDate(1, 0, 0),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	writePair(t, dir, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pkcs8PEM(t, key))

	a, err := LoadOrCreate(Config{CADir: dir}, nil)
	if err == nil {
		a.Close()
		t.Fatal("a CA whose leaves every client rejects was loaded")
	}
	if !strings.Contains(err.Error(), filepath.Join(dir, "ca.pem")) || !strings.Contains(err.Error(), "serverAuth") {
		t.Errorf("load error does not name ca.pem and serverAuth: %v", err)
	}
}
