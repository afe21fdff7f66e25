package mitm

import (
	"errors"
	"fmt"
	"strings"
	"time"
)

// Defaults for the zero fields of Config.
const (
	defaultCADir        = "certs"
	defaultLeafValidity = 7 * 24 * time.Hour
	defaultCacheSize    = 10000
)

// Bounds of Config.LeafValidity. The upper bound is the CA/Browser Forum limit for publicly trusted leaves
// (397 days): browsers apply it to any leaf, even one issued by a locally trusted CA, so a longer validity would
// only produce certificates that Safari and Chrome reject.
const (
	minLeafValidity = time.Hour
	maxLeafValidity = 397 * 24 * time.Hour
)

// Config is the `mitm:` section of config.yaml. Zero values mean the documented defaults.
type Config struct {
	// CADir is where ca.pem (certificate, give it to clients) and ca-key.pem (private key, mode 0600) live.
	// Default "certs".
	CADir string `yaml:"ca_dir"`
	// LeafValidity is how long a minted leaf certificate is valid. Default 168h (7 days).
	// Must be >= 1h and <= 397 days.
	LeafValidity time.Duration `yaml:"leaf_validity"`
	// CacheSize bounds how many leaf certificates are kept in memory. Default 10000. Must be >= 1.
	CacheSize int `yaml:"cert_cache_size"`
}

// WithDefaults returns c with every zero field set to its default.
func (c Config) WithDefaults() Config {
	if c.CADir == "" {
		c.CADir = defaultCADir
	}
	if c.LeafValidity == 0 {
		c.LeafValidity = defaultLeafValidity
	}
	if c.CacheSize == 0 {
		c.CacheSize = defaultCacheSize
	}
	return c
}

// Validate reports every invalid field at once, joined with errors.Join. Zero fields are valid: they stand for the
// defaults. Each message starts with the field's yaml key; the caller adds the section prefix ("mitm.").
func (c Config) Validate() error {
	var errs []error
	// A NUL byte cannot be part of a path on any OS we run on; catching it here gives a config error instead of a
	// puzzling "invalid argument" at startup.
	if strings.ContainsRune(c.CADir, 0) {
		errs = append(errs, errors.New("ca_dir: must not contain a NUL byte"))
	}
	if c.LeafValidity != 0 {
		if c.LeafValidity < minLeafValidity {
			errs = append(errs, fmt.Errorf("leaf_validity: must be at least 1h, got %s", shortDuration(c.LeafValidity)))
		} else if c.LeafValidity > maxLeafValidity {
			errs = append(errs, fmt.Errorf("leaf_validity: must be at most 397 days (9528h), got %s",
				shortDuration(c.LeafValidity)))
		}
	}
	if c.CacheSize < 0 {
		errs = append(errs, fmt.Errorf("cert_cache_size: must be at least 1, got %d", c.CacheSize))
	}
	return errors.Join(errs...)
}

// shortDuration formats d the way a user writes it in config.yaml ("10m", "2h") rather than time.Duration's
// "10m0s", so that error messages quote back something recognizable.
func shortDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}
