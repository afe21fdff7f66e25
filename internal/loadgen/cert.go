package loadgen

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// File names used inside OriginOptions.CertDir.
const (
	originCertFile = "origin.pem"
	originKeyFile  = "origin-key.pem"
)

// originCertValidity is how long a generated origin certificate is valid.
// An expired certificate in a CertDir is replaced on the next start.
const originCertValidity = 2 * 365 * 24 * time.Hour

// originCert is a certificate with its PEM encoding, which is what a proxy
// is told to trust.
type originCert struct {
	tls     tls.Certificate
	certPEM []byte
}

// loadOrCreateCert returns the certificate stored in dir, creating it (and
// dir) when neither file exists or when the stored certificate has expired.
// A pair that exists but cannot be loaded is an error rather than being
// overwritten, so a hand-placed certificate is never destroyed silently.
func loadOrCreateCert(dir string) (*originCert, error) {
	certPath := filepath.Join(dir, originCertFile)
	keyPath := filepath.Join(dir, originKeyFile)

	certPEM, certErr := os.ReadFile(certPath)
	_, keyErr := os.Stat(keyPath)
	switch {
	case errors.Is(certErr, fs.ErrNotExist) && errors.Is(keyErr, fs.ErrNotExist):
		return createCertFiles(dir, certPath, keyPath)
	case certErr != nil:
		return nil, fmt.Errorf("read origin cert: %w", certErr)
	case keyErr != nil:
		return nil, fmt.Errorf("read origin key: %w", keyErr)
	}

	pair, err := tls.LoadX509KeyPair(certPath, keyPath)
	if err != nil {
		return nil, fmt.Errorf("load origin cert from %s (delete %s and %s to regenerate): %w",
			dir, originCertFile, originKeyFile, err)
	}
	leaf := pair.Leaf // set by LoadX509KeyPair unless GODEBUG=x509keypairleaf=0
	if leaf == nil {
		if leaf, err = x509.ParseCertificate(pair.Certificate[0]); err != nil {
			return nil, fmt.Errorf("parse origin cert: %w", err)
		}
		pair.Leaf = leaf
	}
	if time.Now().After(leaf.NotAfter) {
		return createCertFiles(dir, certPath, keyPath)
	}
	return &originCert{tls: pair, certPEM: certPEM}, nil
}

// createCertFiles generates a certificate and writes it to certPath and
// keyPath (0600). Each file is written to a temporary name and renamed, so a
// concurrent reader never sees a partial file.
func createCertFiles(dir, certPath, keyPath string) (*originCert, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create cert dir: %w", err)
	}
	c, keyPEM, err := newOriginCert()
	if err != nil {
		return nil, err
	}
	if err := writeFileAtomic(keyPath, keyPEM, 0o600); err != nil {
		return nil, fmt.Errorf("write origin key: %w", err)
	}
	if err := writeFileAtomic(certPath, c.certPEM, 0o644); err != nil {
		return nil, fmt.Errorf("write origin cert: %w", err)
	}
	return c, nil
}

// newOriginCert generates a self-signed ECDSA P-256 certificate for
// 127.0.0.1, ::1 and localhost. It is marked as a CA so that it can be put in
// a trust store as is; it signs nothing but itself.
func newOriginCert() (c *originCert, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("generate origin key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return nil, nil, fmt.Errorf("generate serial: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{Organization: []string{"onceload"}, CommonName: "onceload origin"},
		NotBefore:             now.Add(-time.Hour), // tolerate clock skew
		NotAfter:              now.Add(originCertValidity),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
		DNSNames:              []string{"localhost"},
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, fmt.Errorf("create origin cert: %w", err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, fmt.Errorf("parse origin cert: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, fmt.Errorf("marshal origin key: %w", err)
	}
	c = &originCert{
		tls: tls.Certificate{
			Certificate: [][]byte{der},
			PrivateKey:  key,
			Leaf:        leaf,
		},
		certPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
	}
	keyPEM = pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	return c, keyPEM, nil
}

// writeFileAtomic writes data to a temporary file next to path and renames
// it into place.
func writeFileAtomic(path string, data []byte, perm os.FileMode) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp) // no-op after a successful rename
	if err := f.Chmod(perm); err != nil {
		f.Close()
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
