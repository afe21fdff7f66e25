package mitm

import (
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
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

// TestIPv4MappedLeafWithCurl: a client that dials an IPv4 address in its
// IPv4-mapped IPv6 form (CONNECT [::ffff:127.0.0.1]:443) gets the one
// leaf of that address, and curl, which like OpenSSL compares the 16
// bytes it dialed, accepts it; it rejected a leaf naming the 4 bytes
// only ("no alternative certificate subject name matches").
func TestIPv4MappedLeafWithCurl(t *testing.T) {
	curl, err := exec.LookPath("curl")
	if err != nil {
		t.Skip("curl not installed")
	}
	a := newTestAuthority(t, Config{}, nil)
	cert, err := a.Leaf(t.Context(), "::ffff:127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{*cert}}
	srv.StartTLS()
	defer srv.Close()
	caFile := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(caFile, a.CertPEM(), 0o600); err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(srv.Listener.Addr().String())
	for _, host := range []string{"[::ffff:127.0.0.1]", "127.0.0.1"} {
		out, err := exec.CommandContext(t.Context(), curl, "-sS", "--max-time", "10", "--noproxy", "*",
			"--cacert", caFile, "https://"+host+":"+port+"/").CombinedOutput()
		if err != nil || string(out) != "ok" {
			t.Errorf("curl https://%s: %v: %s", host, err, out)
		}
	}
}
