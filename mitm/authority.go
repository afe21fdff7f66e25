// Package mitm is the certificate authority of the proxy. It owns the local CA, which it loads from a directory or
// creates there on first start, and it mints the TLS leaf certificates that let the proxy terminate intercepted TLS
// for any host. It knows nothing about HTTP: the proxy package asks it for a *tls.Config and does the rest.
package mitm

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math/big"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/maypok86/otter/v2"
)

// File names inside Config.CADir.
const (
	certFileName = "ca.pem"
	keyFileName  = "ca-key.pem"
)

const caValidityYears = 10

// Authority is the local CA: it holds the CA certificate and key and a bounded cache of minted leaves.
// It is safe for concurrent use. Create it with LoadOrCreate and stop it with Close.
type Authority struct {
	cfg      Config
	logger   *slog.Logger
	certPath string
	keyPath  string
	certPEM  []byte
	caCert   *x509.Certificate
	caKey    crypto.Signer

	// leafKey is the key pair of every leaf. Sharing one key turns minting into a single CA signature instead of
	// a key generation per host. It lives only in memory and is regenerated on every start, so it is never on
	// disk to be stolen.
	leafKey *ecdsa.PrivateKey

	// now is the clock for certificate validity and for the cache's expiry, so that tests can move time for
	// both at once. Defaults to time.Now.
	now    func() time.Time
	clock  *cacheClock
	cache  *otter.Cache[string, *tls.Certificate]
	loader otter.Loader[string, *tls.Certificate]

	mints     atomic.Uint64
	closeOnce sync.Once
}

// Stats is a snapshot of the Authority's counters.
type Stats struct {
	// Mints counts the leaf certificates signed since start.
	Mints uint64
	// Cached is the number of leaves in the cache now. It may briefly exceed the bound until the cache's
	// maintenance has run.
	Cached int
}

// LoadOrCreate loads <CADir>/ca.pem and ca-key.pem, or creates an ECDSA P-256 CA there on first start.
// It refuses to overwrite a lone ca.pem or ca-key.pem. A nil logger discards logs.
func LoadOrCreate(cfg Config, logger *slog.Logger) (*Authority, error) {
	return loadOrCreate(cfg, logger, time.Now)
}

func loadOrCreate(cfg Config, logger *slog.Logger, now func() time.Time) (*Authority, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("mitm: invalid config: %w", err)
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	a := &Authority{
		cfg:      cfg,
		logger:   logger,
		certPath: filepath.Join(cfg.CADir, certFileName),
		keyPath:  filepath.Join(cfg.CADir, keyFileName),
		now:      now,
	}

	if err := a.loadOrCreateFiles(); err != nil {
		return nil, err
	}

	leafKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("mitm: generate leaf key: %w", err)
	}
	a.leafKey = leafKey
	if err := a.initCache(); err != nil {
		return nil, err
	}
	return a, nil
}

// CertPEM returns the PEM of the CA certificate, the file clients must trust. The caller owns the returned slice.
func (a *Authority) CertPEM() []byte { return bytes.Clone(a.certPEM) }

// CertPath returns the path of ca.pem.
func (a *Authority) CertPath() string { return a.certPath }

// Certificate returns the parsed CA certificate. It is shared: do not modify it.
func (a *Authority) Certificate() *x509.Certificate { return a.caCert }

// Stats returns the current counters.
func (a *Authority) Stats() Stats {
	return Stats{Mints: a.mints.Load(), Cached: a.cache.EstimatedSize()}
}

// Close stops the cache's background goroutines. It is idempotent. Leaf keeps working after Close, but expired
// entries are then only removed when they are looked up.
func (a *Authority) Close() {
	a.closeOnce.Do(func() {
		// StopAllGoroutines waits for the clean-up goroutine, so no Tick call can race with stopping the ticker.
		a.cache.StopAllGoroutines()
		a.clock.stop()
	})
}

// regenHint is appended to every error about an unusable CA: the fix is always the same, and its cost (clients
// must trust the new certificate) should be stated where the user reads it.
func (a *Authority) regenHint() string {
	return fmt.Sprintf("delete both %s and %s to create a new CA on next start (clients must then trust the new %s)",
		a.certPath, a.keyPath, certFileName)
}

// creationWait bounds how long a process waits for another one creating
// the CA in the same directory (several instances started at once on a
// shared volume).
const (
	creationWait = 15 * time.Second
	lockFileName = ".ca.lock"
)

// loadOrCreateFiles loads the CA, or creates it when neither file exists.
// Creation holds a lock on a file in the directory (flock: the kernel
// lets go of it when its holder dies, so no lock can be stale), so that
// instances starting together on one certs/ volume end up with one CA
// instead of mismatched key and certificate files. A lock that could be
// taken for stale (the directory lock this used to be) was removed by one
// instance while another had just taken it afresh, and both created a CA.
func (a *Authority) loadOrCreateFiles() error {
	// The usual start finds both and takes no lock: a read-only volume
	// holding a CA works.
	if certExists, keyExists, err := a.caFiles(); err != nil || (certExists && keyExists) {
		if err != nil {
			return err
		}
		return a.load()
	}
	if err := os.MkdirAll(a.cfg.CADir, 0o755); err != nil {
		return fmt.Errorf("mitm: create ca in %s: %w; make the directory writable by this user, "+
			"or put an existing %s and %s there", a.cfg.CADir, err, certFileName, keyFileName)
	}
	lock := filepath.Join(a.cfg.CADir, lockFileName)
	unlock, err := lockFile(lock, creationWait)
	if err != nil {
		if errors.Is(err, fs.ErrPermission) {
			return fmt.Errorf("mitm: create ca in %s: %w; make the directory writable by this user, "+
				"or put an existing %s and %s there", a.cfg.CADir, err, certFileName, keyFileName)
		}
		return fmt.Errorf("mitm: create ca in %s: %w", a.cfg.CADir, err)
	}
	defer unlock()
	// Under the lock, what is there is final: another instance that held
	// it before us has finished.
	certExists, keyExists, err := a.caFiles()
	switch {
	case err != nil:
		return err
	case certExists && keyExists:
		return a.load()
	case !certExists && !keyExists:
		return a.create()
	case certExists:
		return fmt.Errorf("mitm: found %s but not %s: restore the key, or delete %s to create a new CA "+
			"(clients must then trust the new certificate)", a.certPath, a.keyPath, a.certPath)
	default:
		return fmt.Errorf("mitm: found %s but not %s: restore the certificate, or delete %s to create a new CA "+
			"(clients must then trust the new certificate)", a.keyPath, a.certPath, a.keyPath)
	}
}

// caFiles reports which of the CA's two files exist.
func (a *Authority) caFiles() (certExists, keyExists bool, err error) {
	if certExists, err = exists(a.certPath); err != nil {
		return false, false, fmt.Errorf("mitm: stat ca cert: %w", err)
	}
	if keyExists, err = exists(a.keyPath); err != nil {
		return false, false, fmt.Errorf("mitm: stat ca key: %w", err)
	}
	return certExists, keyExists, nil
}

// create makes a new self-signed CA and writes it to CADir.
func (a *Authority) create() error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("mitm: create ca: generate key: %w", err)
	}
	pub, err := key.PublicKey.Bytes()
	if err != nil {
		return fmt.Errorf("mitm: create ca: encode public key: %w", err)
	}
	// RFC 7093 §2 method 1: the leftmost 160 bits of the SHA-256 of the subjectPublicKey. Leaves copy it into
	// their AuthorityKeyId, which lets clients with several onceproxy CAs installed pick the right one.
	ski := sha256.Sum256(pub)
	serial, err := randomSerial()
	if err != nil {
		return fmt.Errorf("mitm: create ca: %w", err)
	}
	now := a.now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject: pkix.Name{
			CommonName:   caCommonName(),
			Organization: []string{"onceproxy"},
		},
		// An hour of slack for clients whose clock is behind ours.
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.AddDate(caValidityYears, 0, 0),
		IsCA:                  true,
		BasicConstraintsValid: true,
		// Path length 0: this CA signs leaves only. A stolen key can then not be used to mint an intermediate
		// that clients would accept.
		MaxPathLen:     0,
		MaxPathLenZero: true,
		KeyUsage:       x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		SubjectKeyId:   ski[:20],
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return fmt.Errorf("mitm: create ca: sign: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return fmt.Errorf("mitm: create ca: parse: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return fmt.Errorf("mitm: create ca: marshal key: %w", err)
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})

	if err := os.MkdirAll(a.cfg.CADir, 0o755); err != nil {
		return fmt.Errorf("mitm: create ca dir: %w", err)
	}
	// The key goes first: should we crash in between, the next start finds a lone key and says so, instead of
	// finding a certificate that clients may already trust with no key behind it.
	if err := writeFileAtomic(a.keyPath, keyPEM, 0o600); err != nil {
		return fmt.Errorf("mitm: write ca key: %w", err)
	}
	if err := writeFileAtomic(a.certPath, certPEM, 0o644); err != nil {
		return fmt.Errorf("mitm: write ca cert: %w", err)
	}
	syncDir(a.cfg.CADir)

	a.caCert, a.caKey, a.certPEM = cert, key, certPEM
	a.logger.Info("created a new local CA: clients must trust its certificate to accept intercepted TLS",
		"cert", a.certPath,
		"key", a.keyPath,
		"not_after", cert.NotAfter,
		"how_to_trust", fmt.Sprintf("e.g. curl --cacert %s ...; see README: Clients", a.certPath))
	return nil
}

// load reads and checks an existing CA.
func (a *Authority) load() error {
	certPEM, err := os.ReadFile(a.certPath)
	if err != nil {
		return fmt.Errorf("mitm: load ca cert: %w", err)
	}
	cert, err := parseCertPEM(certPEM)
	if err != nil {
		return fmt.Errorf("mitm: load ca cert: %s: %w; %s", a.certPath, err, a.regenHint())
	}
	keyPEM, err := readPrivateFile(a.keyPath)
	if err != nil {
		return fmt.Errorf("mitm: load ca key: %w", err)
	}
	key, err := parseKeyPEM(keyPEM)
	if err != nil {
		return fmt.Errorf("mitm: load ca key: %s: %w; %s", a.keyPath, err, a.regenHint())
	}

	pub, ok := cert.PublicKey.(interface{ Equal(crypto.PublicKey) bool })
	if !ok || !pub.Equal(key.Public()) {
		return fmt.Errorf("mitm: load ca: %s does not match the public key of %s; %s",
			a.keyPath, a.certPath, a.regenHint())
	}
	if !cert.BasicConstraintsValid || !cert.IsCA {
		return fmt.Errorf("mitm: load ca: %s is not a CA certificate (basic constraints CA:TRUE missing); %s",
			a.certPath, a.regenHint())
	}
	if cert.KeyUsage != 0 && cert.KeyUsage&x509.KeyUsageCertSign == 0 {
		return fmt.Errorf("mitm: load ca: %s lacks the certSign key usage, so clients would reject its leaves; %s",
			a.certPath, a.regenHint())
	}
	if !servesTLS(cert) {
		return fmt.Errorf("mitm: load ca: %s limits its extended key usage to uses other than serverAuth, "+
			"so clients would reject every leaf it signs; %s", a.certPath, a.regenHint())
	}
	now := a.now()
	if !now.Before(cert.NotAfter) {
		return fmt.Errorf("mitm: load ca: %s expired at %s; %s",
			a.certPath, cert.NotAfter.UTC().Format(time.RFC3339), a.regenHint())
	}
	if now.Before(cert.NotBefore) {
		a.logger.Warn("the CA certificate is not valid yet: clients will reject intercepted TLS until then "+
			"(is the system clock right?)", "cert", a.certPath, "not_before", cert.NotBefore)
	}
	if cert.NotAfter.Sub(now) < a.cfg.LeafValidity {
		a.logger.Warn("the CA certificate expires soon: leaves are cut short to its expiry; "+a.regenHint(),
			"cert", a.certPath, "not_after", cert.NotAfter)
	}

	a.caCert, a.caKey, a.certPEM = cert, key, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw})
	a.logger.Info("loaded local CA",
		"cert", a.certPath,
		"subject", cert.Subject.String(),
		"key_type", keyType(key),
		"not_after", cert.NotAfter)
	return nil
}

// parseCertPEM returns the first CERTIFICATE block of data. Later blocks are ignored so that a user may keep a
// chain in the file, but only the first certificate signs.
func parseCertPEM(data []byte) (*x509.Certificate, error) {
	for {
		var block *pem.Block
		block, data = pem.Decode(data)
		if block == nil {
			return nil, errors.New("no CERTIFICATE PEM block found")
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("parse certificate: %w", err)
		}
		return cert, nil
	}
}

// parseKeyPEM returns the first private key of data. It takes PKCS#8 (what we write) and the PKCS#1 and SEC 1
// forms that openssl and older tools write for a user's own CA. Other blocks, such as the "EC PARAMETERS" that
// `openssl ecparam -genkey` emits first, are skipped.
func parseKeyPEM(data []byte) (crypto.Signer, error) {
	for {
		var block *pem.Block
		block, data = pem.Decode(data)
		if block == nil {
			return nil, errors.New("no PRIVATE KEY PEM block found")
		}
		var (
			key any
			err error
		)
		switch block.Type {
		case "PRIVATE KEY":
			key, err = x509.ParsePKCS8PrivateKey(block.Bytes)
		case "EC PRIVATE KEY":
			key, err = x509.ParseECPrivateKey(block.Bytes)
		case "RSA PRIVATE KEY":
			key, err = x509.ParsePKCS1PrivateKey(block.Bytes)
		case "ENCRYPTED PRIVATE KEY":
			return nil, errors.New("encrypted private keys are not supported: decrypt it (openssl pkey -in key.pem -out ca-key.pem)")
		default:
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("parse %s: %w", block.Type, err)
		}
		switch k := key.(type) {
		case *ecdsa.PrivateKey:
			return k, nil
		case *rsa.PrivateKey:
			return k, nil
		default:
			return nil, fmt.Errorf("unsupported key type %T: want ECDSA or RSA", key)
		}
	}
}

func keyType(k crypto.Signer) string {
	switch k := k.(type) {
	case *ecdsa.PrivateKey:
		return "ecdsa-" + k.Curve.Params().Name
	case *rsa.PrivateKey:
		return fmt.Sprintf("rsa-%d", k.N.BitLen())
	default:
		return fmt.Sprintf("%T", k)
	}
}

// readPrivateFile reads the CA key after checking, on the open file so the check and the read see the same
// inode, that nobody but the owner can read it: whoever reads this key can intercept the TLS of every client
// that trusts ca.pem.
func readPrivateFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	// Windows has no permission bits to check; its ACLs are out of our reach here.
	if runtime.GOOS != "windows" && fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("%s has mode %04o and is readable by group or others: run chmod 600 %s",
			path, fi.Mode().Perm(), path)
	}
	return io.ReadAll(f)
}

// exists reports whether path exists. A dangling symlink counts as existing, so we fail on it rather than
// write through it.
func exists(path string) (bool, error) {
	_, err := os.Lstat(path)
	if err == nil {
		return true, nil
	}
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	return false, err
}

// writeFileAtomic writes data to a temporary file in the directory of path and renames it into place, so a crash
// never leaves a half-written key or certificate behind.
func writeFileAtomic(path string, data []byte, perm os.FileMode) (err error) {
	// CreateTemp creates the file with mode 0600, so the key is never readable by others, not even briefly.
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*.tmp")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			_ = f.Close()
			_ = os.Remove(tmp)
		}
	}()
	// Chmod, unlike the mode given at creation, is not masked by the umask, so the mode is exactly perm.
	if err = f.Chmod(perm); err != nil {
		return err
	}
	if _, err = f.Write(data); err != nil {
		return err
	}
	if err = f.Sync(); err != nil {
		return err
	}
	if err = f.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// syncDir makes the renames in dir durable. It is best effort: some file systems cannot sync a directory, and the
// files themselves are already synced.
func syncDir(dir string) {
	d, err := os.Open(dir)
	if err != nil {
		return
	}
	_ = d.Sync()
	_ = d.Close()
}

// randomSerial returns a positive 128-bit serial from crypto/rand. RFC 5280 allows up to 20 octets; 128 bits of
// entropy make collisions between leaves of one CA impossible in practice, which matters because clients cache
// certificates by issuer and serial.
func randomSerial() (*big.Int, error) {
	limit := new(big.Int).Lsh(big.NewInt(1), 128)
	for {
		n, err := rand.Int(rand.Reader, limit)
		if err != nil {
			return nil, fmt.Errorf("serial: %w", err)
		}
		// CreateCertificate rejects a zero serial; retrying keeps the full range otherwise.
		if n.Sign() > 0 {
			return n, nil
		}
	}
}

// caCommonName names the CA after the machine, so that a user who trusts CAs from several machines can tell them
// apart in a trust store. RFC 5280 caps a CommonName at 64 characters, so a long hostname is cut.
func caCommonName() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown host"
	}
	const prefix, suffix = "onceproxy local CA (", ")"
	if maxHost := 64 - len(prefix) - len(suffix); len(host) > maxHost {
		// A cut may split a multi-byte rune; x509 would then refuse to encode the name.
		host = strings.ToValidUTF8(host[:maxHost], "")
	}
	return prefix + host + suffix
}

// servesTLS reports whether a CA's extended key usage, if it has one,
// allows TLS server certificates: clients apply a CA's EKU to the chain
// below it, so a CA for client authentication only (a corporate or VPN
// CA) signs leaves that every client rejects.
func servesTLS(ca *x509.Certificate) bool {
	if len(ca.ExtKeyUsage) == 0 && len(ca.UnknownExtKeyUsage) == 0 {
		return true
	}
	for _, u := range ca.ExtKeyUsage {
		if u == x509.ExtKeyUsageServerAuth || u == x509.ExtKeyUsageAny {
			return true
		}
	}
	return false
}
