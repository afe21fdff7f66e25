package upstream

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"os"

	"github.com/seed-a3c387e8/onceproxy/internal/hostmatch"
)

// originTLSConfig builds the client TLS configuration for origins: the system
// roots plus cfg.CAFiles, with verification switched off only for the hosts
// the operator listed by name.
func originTLSConfig(cfg Config, logger *slog.Logger) (*tls.Config, error) {
	roots, err := x509.SystemCertPool()
	if err != nil || roots == nil {
		// A minimal container may have no system store; the configured
		// CA files can still make origins verifiable.
		logger.Warn("no system certificate pool; only upstream.ca_files are trusted", "err", err)
		roots = x509.NewCertPool()
	}
	for i, f := range cfg.CAFiles {
		pemBytes, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("upstream.ca_files[%d]: %w", i, err)
		}
		if !roots.AppendCertsFromPEM(pemBytes) {
			return nil, fmt.Errorf("upstream.ca_files[%d]: %s: no PEM certificates found", i, f)
		}
	}
	conf := &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	if len(cfg.InsecureSkipVerifyHosts) == 0 {
		return conf, nil
	}
	for _, h := range cfg.InsecureSkipVerifyHosts {
		logger.Warn("TLS verification is OFF for origin host: anyone on the path can impersonate it",
			"host", h, "key", "upstream.insecure_skip_verify_hosts")
	}
	skip, err := hostmatch.Compile(cfg.InsecureSkipVerifyHosts)
	if err != nil {
		return nil, fmt.Errorf("upstream.insecure_skip_verify_hosts%w", err)
	}
	// crypto/tls can only skip verification for every host or none. Turn the
	// built-in check off and redo exactly the same verification in
	// VerifyConnection for every host that is not listed (the pattern of the
	// crypto/tls VerifyConnection example).
	conf.InsecureSkipVerify = true
	conf.VerifyConnection = func(cs tls.ConnectionState) error {
		if skip.Match(cs.ServerName) {
			return nil
		}
		if len(cs.PeerCertificates) == 0 {
			return fmt.Errorf("tls: origin %s sent no certificate", cs.ServerName)
		}
		opts := x509.VerifyOptions{
			DNSName:       cs.ServerName,
			Roots:         roots,
			Intermediates: x509.NewCertPool(),
		}
		for _, c := range cs.PeerCertificates[1:] {
			opts.Intermediates.AddCert(c)
		}
		_, err := cs.PeerCertificates[0].Verify(opts)
		return err
	}
	return conf, nil
}
