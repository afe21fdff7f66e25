package app

import (
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/connlimit"
	"github.com/seed-a3c387e8/onceproxy/internal/listenaddr"
	"github.com/seed-a3c387e8/onceproxy/proxy/admin"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// FleetConfig is the `fleet:` section: how the instances of a fleet that
// share a store reach each other. A body too big for the shared store is
// downloaded by the instance that leads its flight, and the other
// instances read it from that one's peer listener as it arrives.
type FleetConfig struct {
	// PeerListen is the peer listener's address; "" turns it off (bodies
	// too big for the store are then fetched by every instance).
	PeerListen string `yaml:"peer_listen"`
	// PeerAdvertise is the address the other instances reach this one's
	// peer listener at; "" = the bound address, which must then not be
	// unspecified (0.0.0.0, [::]).
	PeerAdvertise string `yaml:"peer_advertise"`
	// PeerTokenEnv names the environment variable holding the token every
	// instance of the fleet shares: sent by followers, required by the
	// listener. Required when PeerListen is not a loopback address.
	PeerTokenEnv string `yaml:"peer_token_env"`
	// PeerMaxConns caps the connections the peer listener serves at once.
	// Default 256.
	PeerMaxConns int `yaml:"peer_max_conns"`
	// PeerTimeout bounds connecting to a peer and waiting for its
	// response headers; past it the follower fetches from the origin.
	// Default 5s.
	PeerTimeout time.Duration `yaml:"peer_timeout"`
	// PeerIdleTimeout cuts a peer connection on which nothing moved for
	// this long, on both sides; a follower then finishes the body from the
	// origin. Shorter than dedup.stall_timeout. Default 10s.
	PeerIdleTimeout time.Duration `yaml:"peer_idle_timeout"`
}

// WithDefaults returns c with zero fields set to their defaults.
func (c FleetConfig) WithDefaults() FleetConfig {
	if c.PeerMaxConns == 0 {
		c.PeerMaxConns = 256
	}
	if c.PeerTimeout == 0 {
		c.PeerTimeout = 5 * time.Second
	}
	if c.PeerIdleTimeout == 0 {
		c.PeerIdleTimeout = 10 * time.Second
	}
	return c
}

// validateFleet checks the fleet section against the rest of cfg; each
// problem names its key.
func (c *Config) validateFleet(getenv func(string) string) []error {
	f := c.Fleet
	var errs []error
	// Values out of range are refused with the listener off too, as
	// every other section's are, not on the day peer_listen is set.
	if f.PeerMaxConns < 1 {
		errs = append(errs, fmt.Errorf("fleet.peer_max_conns: must be at least 1, got %d", f.PeerMaxConns))
	}
	if f.PeerTimeout <= 0 {
		errs = append(errs, fmt.Errorf("fleet.peer_timeout: must be positive, got %s", f.PeerTimeout))
	}
	if f.PeerIdleTimeout <= 0 {
		errs = append(errs, fmt.Errorf("fleet.peer_idle_timeout: must be positive, got %s", f.PeerIdleTimeout))
	}
	if f.PeerListen == "" {
		if f.PeerAdvertise != "" {
			errs = append(errs, errors.New("fleet.peer_advertise: set without fleet.peer_listen"))
		}
		return errs
	}
	host, _, _ := net.SplitHostPort(f.PeerListen)
	err := listenaddr.Check(f.PeerListen)
	if err != nil {
		errs = append(errs, fmt.Errorf("fleet.peer_listen: %w", err))
	}
	if !c.Redis.Enabled() && !c.Postgres.Enabled() {
		errs = append(errs, errors.New("fleet.peer_listen: set without a shared store (redis.url, redis.addrs or postgres.url): an instance alone has no peers"))
	}
	for _, other := range []struct{ key, addr string }{{"proxy.listen", c.Proxy.Listen}, {"socks5.listen", c.SOCKS5.Listen}, {"admin.listen", c.Admin.Listen}} {
		if other.addr != "" && other.addr == f.PeerListen && !hasZeroPort(f.PeerListen) {
			errs = append(errs, fmt.Errorf("fleet.peer_listen: %s is already %s", f.PeerListen, other.key))
		}
	}
	switch {
	case f.PeerAdvertise != "":
		if !dedup.ValidPeerAddr(f.PeerAdvertise) || unspecifiedHost(hostOf(f.PeerAdvertise)) {
			errs = append(errs, fmt.Errorf("fleet.peer_advertise: %q is not an address other instances can dial (host:port, a host that is not 0.0.0.0 or [::], a port)", f.PeerAdvertise))
		}
	case err == nil && unspecifiedHost(host):
		errs = append(errs, fmt.Errorf("fleet.peer_advertise: fleet.peer_listen (%s) binds every address: name the address the other instances reach this one at", f.PeerListen))
	}
	switch {
	case f.PeerTokenEnv != "" && peerToken(f, getenv) == "":
		errs = append(errs, fmt.Errorf("fleet.peer_token_env: %s is unset or empty", f.PeerTokenEnv))
	case f.PeerTokenEnv == "" && !listenaddr.Loopback(f.PeerListen):
		errs = append(errs, fmt.Errorf("fleet.peer_token_env: none configured while fleet.peer_listen (%s) is not a loopback address: anyone who reaches it could read the bodies this instance holds; name a variable holding the fleet's shared token", f.PeerListen))
	}
	if f.PeerIdleTimeout > 0 && f.PeerIdleTimeout >= c.Dedup.StallTimeout {
		errs = append(errs, fmt.Errorf("fleet.peer_idle_timeout: must be shorter than dedup.stall_timeout (%s), so that a follower whose peer went silent can still finish the body from the origin, got %s", c.Dedup.StallTimeout, f.PeerIdleTimeout))
	}
	return errs
}

func hasZeroPort(addr string) bool {
	_, port, err := net.SplitHostPort(addr)
	return err == nil && port == "0"
}

func hostOf(addr string) string {
	host, _, _ := net.SplitHostPort(addr)
	return host
}

// unspecifiedHost reports whether a listen host binds every address.
func unspecifiedHost(host string) bool {
	if host == "" {
		return true
	}
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.IsUnspecified()
}

// peerAdvertised is the address other instances reach ln at:
// fleet.peer_advertise, or the bound address (validation made sure it is
// not unspecified).
func peerAdvertised(c FleetConfig, ln net.Listener) string {
	if c.PeerAdvertise != "" {
		return c.PeerAdvertise
	}
	return ln.Addr().String()
}

// peerToken is the fleet's shared token ("" on a loopback listener
// without one), white space trimmed as adminToken's.
func peerToken(c FleetConfig, getenv func(string) string) string {
	if c.PeerTokenEnv == "" {
		return ""
	}
	return strings.TrimSpace(getenv(c.PeerTokenEnv))
}

// peerServer serves the engine's bodies to the other instances on the
// peer listener: the token checked first, a cap on connections, deadlines
// on headers and on silence.
type peerServer struct {
	srv *http.Server
	ln  *connlimit.Listener
}

// newPeerServer serves h on ln; advertised is the address the other
// instances are told to use, which they send as Host.
func newPeerServer(c FleetConfig, ln net.Listener, token, advertised string, h http.Handler, logger *slog.Logger) *peerServer {
	if token == "" {
		// Only a loopback listener goes without a token (Validate), and a
		// browser on this machine can reach it.
		h = admin.RequireLocalHost(h, advertised)
	} else {
		h = peerAuth(token, h)
	}
	return &peerServer{
		ln: connlimit.New(ln, connlimit.Config{MaxConns: c.PeerMaxConns, IdleTimeout: c.PeerIdleTimeout}),
		srv: &http.Server{
			Handler:           h,
			ReadHeaderTimeout: c.PeerTimeout,
			IdleTimeout:       time.Minute,
			MaxHeaderBytes:    16 << 10,
			ConnState:         connlimit.ConnState,
			ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
		},
	}
}

// serve runs until shutdown.
func (p *peerServer) serve() error {
	if err := p.srv.Serve(p.ln); !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("fleet.peer_listen: %w", err)
	}
	return nil
}

// peerAuth requires the fleet's token. Both sides are hashed before the
// constant-time comparison, so that neither the token's bytes nor its
// length show in how long a refusal takes.
func peerAuth(token string, next http.Handler) http.Handler {
	want := sha256.Sum256([]byte("Bearer " + token))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got := sha256.Sum256([]byte(r.Header.Get("Authorization")))
		if subtle.ConstantTimeCompare(got[:], want[:]) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="onceproxy-peer"`)
			http.Error(w, "onceproxy peer listener: the fleet's token is required (fleet.peer_token_env)", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}
