package mitm

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"log/slog"
	"math/big"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestCreateThenReload(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "nested", "certs") // LoadOrCreate must create it
	var logs bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))

	a1, err := LoadOrCreate(Config{CADir: dir}, logger)
	if err != nil {
		t.Fatalf("LoadOrCreate (create): %v", err)
	}
	a1.Close()
	if got, want := a1.CertPath(), filepath.Join(dir, "ca.pem"); got != want {
		t.Errorf("CertPath() = %q, want %q", got, want)
	}
	createLog := logs.String()
	for _, want := range []string{"level=INFO", "curl --cacert " + a1.CertPath(), "README: Clients"} {
		if !strings.Contains(createLog, want) {
			t.Errorf("creation log lacks %q:\n%s", want, createLog)
		}
	}

	for _, f := range []struct {
		name string
		mode os.FileMode
	}{{"ca.pem", 0o644}, {"ca-key.pem", 0o600}} {
		fi, err := os.Stat(filepath.Join(dir, f.name))
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode().Perm(); got != f.mode {
			t.Errorf("mode of %s = %04o, want %04o", f.name, got, f.mode)
		}
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if want := []string{lockFileName, "ca-key.pem", "ca.pem"}; !slices.Equal(names, want) {
		t.Errorf("files in CA dir = %q, want %q (no temp files left behind)", names, want)
	}
	onDisk, err := os.ReadFile(a1.CertPath())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(onDisk, a1.CertPEM()) {
		t.Errorf("CertPEM() differs from %s", a1.CertPath())
	}

	logs.Reset()
	a2, err := LoadOrCreate(Config{CADir: dir}, logger)
	if err != nil {
		t.Fatalf("LoadOrCreate (reload): %v", err)
	}
	defer a2.Close()
	if !bytes.Equal(a1.Certificate().Raw, a2.Certificate().Raw) {
		t.Error("reloaded CA certificate differs from the created one")
	}
	if !bytes.Equal(a1.CertPEM(), a2.CertPEM()) {
		t.Error("reloaded CertPEM differs from the created one")
	}
	if !strings.Contains(logs.String(), "loaded local CA") {
		t.Errorf("reload log lacks %q:\n%s", "loaded local CA", logs.String())
	}
	if a1.leafKey.Equal(a2.leafKey) {
		t.Error("leaf key survived a restart; it must be generated per process")
	}
}

func TestCreatedCA(t *testing.T) {
	start := time.Now()
	a := newTestAuthority(t, Config{}, nil)
	ca := a.Certificate()

	pub, ok := ca.PublicKey.(*ecdsa.PublicKey)
	if !ok || pub.Curve != elliptic.P256() {
		t.Errorf("CA public key = %T, want ECDSA P-256", ca.PublicKey)
	}
	if !strings.HasPrefix(ca.Subject.CommonName, "onceproxy local CA (") {
		t.Errorf("CN = %q, want prefix %q", ca.Subject.CommonName, "onceproxy local CA (")
	}
	if len(ca.Subject.CommonName) > 64 {
		t.Errorf("CN is %d characters, more than 64", len(ca.Subject.CommonName))
	}
	if !slices.Equal(ca.Subject.Organization, []string{"onceproxy"}) {
		t.Errorf("O = %q, want [onceproxy]", ca.Subject.Organization)
	}
	if ca.SerialNumber.Sign() <= 0 || ca.SerialNumber.BitLen() > 128 {
		t.Errorf("serial %x: want positive and at most 128 bits", ca.SerialNumber)
	}
	if !ca.IsCA || !ca.BasicConstraintsValid || ca.MaxPathLen != 0 || !ca.MaxPathLenZero {
		t.Errorf("basic constraints: IsCA=%v valid=%v MaxPathLen=%d zero=%v, want CA with path length 0",
			ca.IsCA, ca.BasicConstraintsValid, ca.MaxPathLen, ca.MaxPathLenZero)
	}
	if want := x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature; ca.KeyUsage != want {
		t.Errorf("KeyUsage = %b, want %b", ca.KeyUsage, want)
	}
	if len(ca.SubjectKeyId) == 0 {
		t.Error("SubjectKeyId is empty")
	}
	if d := start.Add(-time.Hour).Sub(ca.NotBefore); d < -2*time.Second || d > 2*time.Second {
		t.Errorf("NotBefore = %v, want about now-1h", ca.NotBefore)
	}
	if want := start.AddDate(10, 0, 0); ca.NotAfter.Sub(want).Abs() > 2*time.Second {
		t.Errorf("NotAfter = %v, want about %v", ca.NotAfter, want)
	}
	if err := ca.CheckSignatureFrom(ca); err != nil {
		t.Errorf("CA is not self-signed: %v", err)
	}

	keyPEM, err := os.ReadFile(filepath.Join(a.cfg.CADir, "ca-key.pem"))
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(keyPEM)
	if block == nil || block.Type != "PRIVATE KEY" {
		t.Fatalf("ca-key.pem is not a PKCS#8 PRIVATE KEY PEM")
	}
	if _, err := x509.ParsePKCS8PrivateKey(block.Bytes); err != nil {
		t.Errorf("ca-key.pem: %v", err)
	}
}

func TestLoadErrors(t *testing.T) {
	// Each setup leaves dir in a state that LoadOrCreate must refuse, with an error that tells the user what to do.
	tests := []struct {
		name  string
		setup func(t *testing.T, dir string)
		want  []string
	}{
		{
			name: "cert without key",
			setup: func(t *testing.T, dir string) {
				createCA(t, dir)
				mustRemove(t, filepath.Join(dir, "ca-key.pem"))
			},
			want: []string{"found " + "%DIR%/ca.pem but not %DIR%/ca-key.pem", "create a new CA"},
		},
		{
			name: "key without cert",
			setup: func(t *testing.T, dir string) {
				createCA(t, dir)
				mustRemove(t, filepath.Join(dir, "ca.pem"))
			},
			want: []string{"found %DIR%/ca-key.pem but not %DIR%/ca.pem"},
		},
		{
			name: "key readable by others",
			setup: func(t *testing.T, dir string) {
				createCA(t, dir)
				if err := os.Chmod(filepath.Join(dir, "ca-key.pem"), 0o644); err != nil {
					t.Fatal(err)
				}
			},
			want: []string{"mitm: load ca key:", "mode 0644", "chmod 600 %DIR%/ca-key.pem"},
		},
		{
			name: "key readable by group",
			setup: func(t *testing.T, dir string) {
				createCA(t, dir)
				if err := os.Chmod(filepath.Join(dir, "ca-key.pem"), 0o640); err != nil {
					t.Fatal(err)
				}
			},
			want: []string{"chmod 600"},
		},
		{
			name: "garbage cert",
			setup: func(t *testing.T, dir string) {
				createCA(t, dir)
				mustWrite(t, filepath.Join(dir, "ca.pem"), []byte("this is not a certificate\n"), 0o644)
			},
			want: []string{"mitm: load ca cert:", "no CERTIFICATE PEM block", "delete both"},
		},
		{
			name: "corrupt cert DER",
			setup: func(t *testing.T, dir string) {
				createCA(t, dir)
				mustWrite(t, filepath.Join(dir, "ca.pem"),
					pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: []byte{0x30, 0x03, 1, 2, 3}}), 0o644)
			},
			want: []string{"mitm: load ca cert:", "parse certificate", "delete both"},
		},
		{
			name: "garbage key",
			setup: func(t *testing.T, dir string) {
				createCA(t, dir)
				mustWrite(t, filepath.Join(dir, "ca-key.pem"), []byte("garbage"), 0o600)
			},
			want: []string{"mitm: load ca key:", "no PRIVATE KEY PEM block", "delete both"},
		},
		{
			name: "corrupt key DER",
			setup: func(t *testing.T, dir string) {
				createCA(t, dir)
				mustWrite(t, filepath.Join(dir, "ca-key.pem"),
					pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: []byte("nope")}), 0o600)
			},
			want: []string{"mitm: load ca key:", "parse PRIVATE KEY"},
		},
		{
			name: "encrypted key",
			setup: func(t *testing.T, dir string) {
				createCA(t, dir)
				mustWrite(t, filepath.Join(dir, "ca-key.pem"),
					pem.EncodeToMemory(&pem.Block{Type: "ENCRYPTED PRIVATE KEY", Bytes: []byte("x")}), 0o600)
			},
			want: []string{"encrypted private keys are not supported"},
		},
		{
			name: "key of another CA",
			setup: func(t *testing.T, dir string) {
				createCA(t, dir)
				other := t.TempDir()
				createCA(t, other)
				key, err := os.ReadFile(filepath.Join(other, "ca-key.pem"))
				if err != nil {
					t.Fatal(err)
				}
				mustWrite(t, filepath.Join(dir, "ca-key.pem"), key, 0o600)
			},
			want: []string{"%DIR%/ca-key.pem does not match the public key of %DIR%/ca.pem", "delete both"},
		},
		{
			name: "not a CA",
			setup: func(t *testing.T, dir string) {
				key := mustECKey(t)
				writePair(t, dir, selfSigned(t, key, false, time.Now().Add(time.Hour)), pkcs8PEM(t, key))
			},
			want: []string{"is not a CA certificate", "delete both"},
		},
		{
			name: "expired CA",
			setup: func(t *testing.T, dir string) {
				past := newFakeClock(time.Now().AddDate(-11, 0, 0))
				a, err := loadOrCreate(Config{CADir: dir}, nil, past.Now)
				if err != nil {
					t.Fatal(err)
				}
				a.Close()
			},
			want: []string{"expired at", "delete both %DIR%/ca.pem and %DIR%/ca-key.pem"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			tt.setup(t, dir)
			a, err := LoadOrCreate(Config{CADir: dir}, nil)
			if err == nil {
				a.Close()
				t.Fatal("LoadOrCreate succeeded, want an error")
			}
			for _, w := range tt.want {
				w = strings.ReplaceAll(w, "%DIR%", dir)
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\nlacks %q", err, w)
				}
			}
			// A failed load must not have "repaired" anything by writing over the user's files.
			entries, _ := os.ReadDir(dir)
			for _, e := range entries {
				if strings.HasSuffix(e.Name(), ".tmp") {
					t.Errorf("temp file %s left behind", e.Name())
				}
			}
		})
	}
}

func TestLoadLoneFileIsNotOverwritten(t *testing.T) {
	dir := t.TempDir()
	createCA(t, dir)
	keyPath := filepath.Join(dir, "ca-key.pem")
	before, err := os.ReadFile(keyPath)
	if err != nil {
		t.Fatal(err)
	}
	mustRemove(t, filepath.Join(dir, "ca.pem"))
	if _, err := LoadOrCreate(Config{CADir: dir}, nil); err == nil {
		t.Fatal("LoadOrCreate succeeded with a lone key")
	}
	after, err := os.ReadFile(keyPath)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(before, after) {
		t.Error("the lone key was overwritten")
	}
	if _, err := os.Stat(filepath.Join(dir, "ca.pem")); err == nil {
		t.Error("a new ca.pem was written next to the lone key")
	}
}

// A user may bring their own CA in the formats openssl writes; leaves stay ECDSA P-256 whatever the CA key is.
func TestLoadForeignCA(t *testing.T) {
	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	ecKey := mustECKey(t)
	ecSEC1, err := x509.MarshalECPrivateKey(ecKey)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		key    crypto.Signer
		keyPEM []byte
		sigAlg x509.SignatureAlgorithm
	}{
		{
			name:   "rsa pkcs1",
			key:    rsaKey,
			keyPEM: pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(rsaKey)}),
			sigAlg: x509.SHA256WithRSA,
		},
		{name: "rsa pkcs8", key: rsaKey, keyPEM: pkcs8PEM(t, rsaKey), sigAlg: x509.SHA256WithRSA},
		{
			name: "ec sec1 after ec parameters",
			key:  ecKey,
			keyPEM: append(
				pem.EncodeToMemory(&pem.Block{Type: "EC PARAMETERS", Bytes: []byte{6, 8, 42, 134, 72, 206, 61, 3, 1, 7}}),
				pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: ecSEC1})...),
			sigAlg: x509.ECDSAWithSHA256,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			writePair(t, dir, selfSigned(t, tt.key, true, time.Now().AddDate(1, 0, 0)), tt.keyPEM)
			a := newTestAuthority(t, Config{CADir: dir}, nil)

			cert, err := a.Leaf(t.Context(), "byo.test")
			if err != nil {
				t.Fatalf("Leaf: %v", err)
			}
			if _, err := cert.Leaf.Verify(x509.VerifyOptions{DNSName: "byo.test", Roots: caPool(a)}); err != nil {
				t.Errorf("Verify: %v", err)
			}
			if pub, ok := cert.Leaf.PublicKey.(*ecdsa.PublicKey); !ok || pub.Curve != elliptic.P256() {
				t.Errorf("leaf key = %T, want ECDSA P-256", cert.Leaf.PublicKey)
			}
			if got := cert.Leaf.SignatureAlgorithm; got != tt.sigAlg {
				t.Errorf("leaf signature algorithm = %v, want %v", got, tt.sigAlg)
			}
		})
	}
}

// createCA creates a CA in dir the way a first start does.
func createCA(t *testing.T, dir string) {
	t.Helper()
	a, err := LoadOrCreate(Config{CADir: dir}, nil)
	if err != nil {
		t.Fatalf("create CA: %v", err)
	}
	a.Close()
}

func mustECKey(t *testing.T) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func selfSigned(t *testing.T, key crypto.Signer, isCA bool, notAfter time.Time) []byte {
	t.Helper()
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(42),
		Subject:               pkix.Name{CommonName: "test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              notAfter,
		IsCA:                  isCA,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func pkcs8PEM(t *testing.T, key any) []byte {
	t.Helper()
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})
}

func writePair(t *testing.T, dir string, certPEM, keyPEM []byte) {
	t.Helper()
	mustWrite(t, filepath.Join(dir, "ca.pem"), certPEM, 0o644)
	mustWrite(t, filepath.Join(dir, "ca-key.pem"), keyPEM, 0o600)
}

func mustWrite(t *testing.T, path string, data []byte, mode os.FileMode) {
	t.Helper()
	if err := os.WriteFile(path, data, mode); err != nil {
		t.Fatal(err)
	}
	// WriteFile keeps the mode of an existing file; the tests mean the mode they pass.
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
}

func mustRemove(t *testing.T, path string) {
	t.Helper()
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
}

// TestConcurrentFirstStart: several instances starting at once on one
// empty certs directory (a shared volume) end up with one CA.
func TestConcurrentFirstStart(t *testing.T) {
	dir := t.TempDir()
	const n = 6
	certs := make(chan []byte, n)
	errs := make(chan error, n)
	start := make(chan struct{})
	for range n {
		go func() {
			<-start
			a, err := LoadOrCreate(Config{CADir: dir}, nil)
			if err != nil {
				errs <- err
				return
			}
			defer a.Close()
			certs <- a.CertPEM()
		}()
	}
	close(start)
	var first []byte
	for range n {
		select {
		case err := <-errs:
			t.Fatal(err)
		case c := <-certs:
			if first == nil {
				first = c
			} else if !bytes.Equal(c, first) {
				t.Fatal("two instances ended up with different CAs")
			}
		}
	}
	// The lock file stays (see lockFile), but nobody holds it.
	unlock, err := lockFile(filepath.Join(dir, lockFileName), 0)
	if err != nil {
		t.Fatalf("creation lock still held: %v", err)
	}
	unlock()
}
