package socks

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/listenaddr"
)

// DefaultListen is the SOCKS5 address of the shipped configuration.
// WithDefaults does not apply it: "" is a meaningful setting (the SOCKS5
// port is off), so the default lives in config.yaml, like admin.listen.
const DefaultListen = "127.0.0.1:1080"

// Config is the `socks5:` section of config.yaml: the SOCKS5 front door,
// which feeds the same pipeline as the HTTP port (MITM, dedup, cache,
// sessions, auth). Zero values mean the documented defaults (see
// WithDefaults), except Listen and AllowNoAuth, whose zero values are
// settings of their own.
//
// The SOCKS5 port shares the HTTP port's limits from the `proxy:` section
// (see Options): max_conns (a cap of its own, of the same size),
// idle_timeout, read_header_timeout (which bounds the SOCKS5 greeting,
// authentication and request), dial_timeout (blind tunnels) and
// bypass_hosts.
type Config struct {
	// Listen is the SOCKS5 address; "" turns the SOCKS5 port off. The
	// shipped config.yaml sets DefaultListen.
	Listen string `yaml:"listen"`
	// AllowNoAuth lets clients in without a verified user name and password
	// when no user store is configured (Options.Users is nil): they may then
	// use "no authentication", or send any user name and password, whose
	// session hints ("acct-session-ID") are used unverified. With a user
	// store, this key is ignored and every client must authenticate.
	AllowNoAuth bool `yaml:"allow_no_auth"`
	// MITMPorts are the target ports on which a CONNECT is answered at once
	// and its stream sniffed before anything is dialled: TLS and HTTP go
	// into the MITM pipeline without a wasted upstream dial. Other ports are
	// dialled first, so that a failure becomes a SOCKS5 reply code; they are
	// still intercepted when the client turns out to speak TLS or HTTP.
	// Default [80, 443, 8080, 8443].
	MITMPorts []int `yaml:"mitm_ports"`
	// SniffTimeout is how long a client on a MITM port may stay silent
	// before the upstream is dialled anyway, for protocols where the server
	// speaks first (its greeting is then tunnelled blind). A TLS or HTTP
	// client that speaks later, before the server, is still intercepted.
	// Default 500ms.
	SniffTimeout time.Duration `yaml:"sniff_timeout"`
}

// WithDefaults returns c with zero fields set to their defaults. Listen and
// AllowNoAuth are left alone (see Config). An explicitly empty MITMPorts
// list (not nil) stays empty: every port is then dialled first.
func (c Config) WithDefaults() Config {
	if c.MITMPorts == nil {
		c.MITMPorts = []int{80, 443, 8080, 8443}
	}
	if c.SniffTimeout == 0 {
		c.SniffTimeout = 500 * time.Millisecond
	}
	return c
}

// Validate reports every problem in c, each prefixed with its yaml key.
func (c Config) Validate() error {
	var errs []error
	if c.Listen != "" {
		if err := listenaddr.Check(c.Listen); err != nil {
			errs = append(errs, fmt.Errorf(`listen: %w ("" turns SOCKS5 off)`, err))
		}
	}
	for i, p := range c.MITMPorts {
		if p < 1 || p > 65535 {
			errs = append(errs, fmt.Errorf("mitm_ports[%d]: %d is not a port (1-65535)", i, p))
		}
	}
	if c.SniffTimeout <= 0 {
		errs = append(errs, fmt.Errorf("sniff_timeout: must be positive, got %s", c.SniffTimeout))
	}
	return errors.Join(errs...)
}

func (c Config) isMITMPort(port int) bool { return slices.Contains(c.MITMPorts, port) }
