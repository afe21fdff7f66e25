package app

import (
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestFleetConfig: the peer listener's settings are checked at start-up,
// each problem naming its key: a listener reachable from the network
// without a token, one bound to every address without an advertised
// address, a token variable that is empty, a listener without a shared
// store, an idle timeout the stall timeout would beat, a value out of
// range whether or not the listener is on.
func TestFleetConfig(t *testing.T) {
	const redis = "ONCEPROXY_REDIS_URL=redis://127.0.0.1:1"
	for _, tc := range []struct {
		name string
		env  []string
		want string // "" = valid
	}{
		{name: "loopback without a token", env: []string{redis, "ONCEPROXY_FLEET_PEER_LISTEN=127.0.0.1:0"}},
		{name: "network with a token", env: []string{redis, "ONCEPROXY_FLEET_PEER_LISTEN=10.0.0.1:7070", "ONCEPROXY_FLEET_PEER_TOKEN_ENV=PEER_TOKEN", "PEER_TOKEN=s3cret"}},
		{name: "network without a token", env: []string{redis, "ONCEPROXY_FLEET_PEER_LISTEN=10.0.0.1:7070"}, want: "fleet.peer_token_env: none configured while fleet.peer_listen (10.0.0.1:7070) is not a loopback address"},
		{name: "token variable empty", env: []string{redis, "ONCEPROXY_FLEET_PEER_LISTEN=127.0.0.1:0", "ONCEPROXY_FLEET_PEER_TOKEN_ENV=PEER_TOKEN"}, want: "fleet.peer_token_env: PEER_TOKEN is unset or empty"},
		{name: "every address, not advertised", env: []string{redis, "ONCEPROXY_FLEET_PEER_LISTEN=0.0.0.0:7070", "ONCEPROXY_FLEET_PEER_TOKEN_ENV=T", "T=x"}, want: "fleet.peer_advertise: fleet.peer_listen (0.0.0.0:7070) binds every address"},
		{name: "every address, advertised", env: []string{redis, "ONCEPROXY_FLEET_PEER_LISTEN=:7070", "ONCEPROXY_FLEET_PEER_ADVERTISE=10.0.0.1:7070", "ONCEPROXY_FLEET_PEER_TOKEN_ENV=T", "T=x"}},
		{name: "advertised unspecified", env: []string{redis, "ONCEPROXY_FLEET_PEER_LISTEN=127.0.0.1:7070", "ONCEPROXY_FLEET_PEER_ADVERTISE=0.0.0.0:7070"}, want: "fleet.peer_advertise:"},
		{name: "advertised without a port", env: []string{redis, "ONCEPROXY_FLEET_PEER_LISTEN=127.0.0.1:7070", "ONCEPROXY_FLEET_PEER_ADVERTISE=peer.internal"}, want: "fleet.peer_advertise:"},
		{name: "advertised without a listener", env: []string{redis, "ONCEPROXY_FLEET_PEER_ADVERTISE=10.0.0.1:7070"}, want: "fleet.peer_advertise: set without fleet.peer_listen"},
		{name: "no shared store", env: []string{"ONCEPROXY_FLEET_PEER_LISTEN=127.0.0.1:0"}, want: "fleet.peer_listen: set without a shared store"},
		{name: "not host:port", env: []string{redis, "ONCEPROXY_FLEET_PEER_LISTEN=nope"}, want: "fleet.peer_listen:"},
		{name: "idle past the stall", env: []string{redis, "ONCEPROXY_FLEET_PEER_LISTEN=127.0.0.1:0", "ONCEPROXY_FLEET_PEER_IDLE_TIMEOUT=30s"}, want: "fleet.peer_idle_timeout: must be shorter than dedup.stall_timeout (30s)"},
		{name: "no connections", env: []string{redis, "ONCEPROXY_FLEET_PEER_LISTEN=127.0.0.1:0", "ONCEPROXY_FLEET_PEER_MAX_CONNS=-1"}, want: "fleet.peer_max_conns:"},
		// Bad values are refused with the listener off too, as every
		// other section's are: they used to pass until the day
		// peer_listen was set.
		{name: "no connections, listener off", env: []string{"ONCEPROXY_FLEET_PEER_MAX_CONNS=-1"}, want: "fleet.peer_max_conns: must be at least 1, got -1"},
		{name: "negative timeout, listener off", env: []string{"ONCEPROXY_FLEET_PEER_TIMEOUT=-1s"}, want: "fleet.peer_timeout: must be positive, got -1s"},
		{name: "negative idle timeout, listener off", env: []string{"ONCEPROXY_FLEET_PEER_IDLE_TIMEOUT=-1s"}, want: "fleet.peer_idle_timeout: must be positive, got -1s"},
		{name: "same as the proxy", env: []string{redis, "ONCEPROXY_FLEET_PEER_LISTEN=127.0.0.1:8080"}, want: "fleet.peer_listen: 127.0.0.1:8080 is already proxy.listen"},
	} {
		t.Run(tc.name, func(t *testing.T) { expectLoad(t, tc.env, tc.want) })
	}
}

// TestPeerAuth: the peer listener serves only requests that carry the
// fleet's token.
func TestPeerAuth(t *testing.T) {
	srv := httptest.NewServer(peerAuth("s3cret", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("object")) })))
	defer srv.Close()
	for _, tc := range []struct {
		auth string
		want int
	}{
		{"", http.StatusUnauthorized},
		{"Bearer nope", http.StatusUnauthorized},
		{"Bearer s3cre", http.StatusUnauthorized},
		{"Basic s3cret", http.StatusUnauthorized},
		{"Bearer s3cret", http.StatusOK},
	} {
		req, _ := http.NewRequest(http.MethodGet, srv.URL+"/dedup/v1/objects/x", nil)
		if tc.auth != "" {
			req.Header.Set("Authorization", tc.auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("Authorization %q: %d, want %d", tc.auth, resp.StatusCode, tc.want)
		}
	}
}

// TestAdminListenerConfig: the admin API, which reloads the configuration,
// rotates sessions and drops the cache, is not opened to a network without
// a token, unless auth.allow_unauthenticated says the port is protected
// otherwise (the container image); a token read from a mounted secret
// loses its trailing newline, which no client sends.
func TestAdminListenerConfig(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  []string
		want string // "" = valid
	}{
		{name: "loopback without a token", env: []string{"ONCEPROXY_ADMIN_LISTEN=127.0.0.1:9090"}},
		{name: "network with a token", env: []string{"ONCEPROXY_ADMIN_LISTEN=0.0.0.0:9090", "ONCEPROXY_ADMIN_TOKEN_ENV=T", "T=s3cret"}},
		{name: "network without a token", env: []string{"ONCEPROXY_ADMIN_LISTEN=0.0.0.0:9090"}, want: "admin.token_env: none configured while admin.listen (0.0.0.0:9090) is not a loopback address"},
		{name: "every address, no host", env: []string{"ONCEPROXY_ADMIN_LISTEN=:9090"}, want: "admin.token_env: none configured while admin.listen (:9090)"},
		{name: "network, protected otherwise", env: []string{"ONCEPROXY_ADMIN_LISTEN=0.0.0.0:9090", "ONCEPROXY_AUTH_ALLOW_UNAUTHENTICATED=true"}},
		{name: "token only white space", env: []string{"ONCEPROXY_ADMIN_TOKEN_ENV=T", "T= \n"}, want: "admin.token_env: T is unset or empty"},
		{name: "off", env: []string{"ONCEPROXY_ADMIN_LISTEN="}},
	} {
		t.Run(tc.name, func(t *testing.T) { expectLoad(t, tc.env, tc.want) })
	}
	getenv := func(string) string { return "s3cret\n" }
	if got := adminToken(AdminConfig{TokenEnv: "T"}, getenv); got != "s3cret" {
		t.Errorf("admin token %q, want the secret without its newline", got)
	}
	if got := peerToken(FleetConfig{PeerTokenEnv: "T"}, getenv); got != "s3cret" {
		t.Errorf("peer token %q, want the secret without its newline", got)
	}
}

// expectLoad loads the shipped configuration with env and checks that it
// is accepted (want "") or refused with an error containing want.
func expectLoad(t *testing.T, env []string, want string) {
	t.Helper()
	_, err := LoadConfig(shippedConfig, "", env)
	switch {
	case want == "" && err != nil:
		t.Fatalf("refused: %v", err)
	case want != "" && (err == nil || !strings.Contains(err.Error(), want)):
		t.Fatalf("error %v, want one containing %q", err, want)
	}
}

// TestPeerWithoutTokenAnswersThisMachineOnly: a loopback peer listener
// without a token (Validate allows no other) answers only requests whose
// Host is a loopback address, localhost or the address it advertises: a
// web page that points a name of its own at 127.0.0.1 (DNS rebinding)
// could otherwise read the bodies it serves. With a token, the token
// decides.
func TestPeerWithoutTokenAnswersThisMachineOnly(t *testing.T) {
	object := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("object")) })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln.Close()
	open := httptest.NewServer(newPeerServer(FleetConfig{}, ln, "", "peer.localdomain:7070", object, slog.New(slog.DiscardHandler)).srv.Handler)
	defer open.Close()
	port := strings.TrimPrefix(open.URL, "http://127.0.0.1:")
	for _, tc := range []struct {
		host string
		want int
	}{
		{"127.0.0.1:" + port, http.StatusOK},
		{"localhost:" + port, http.StatusOK},
		{"[::1]:" + port, http.StatusOK},
		{"peer.localdomain:7070", http.StatusOK},
		{"attacker.example:" + port, http.StatusMisdirectedRequest},
		{"attacker.example", http.StatusMisdirectedRequest},
	} {
		req, _ := http.NewRequest(http.MethodGet, open.URL+"/dedup/v1/objects/x", nil)
		req.Host = tc.host
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("Host %q: %d, want %d", tc.host, resp.StatusCode, tc.want)
		}
	}
	tokened := httptest.NewServer(newPeerServer(FleetConfig{}, ln, "s3cret", "10.0.0.1:7070", object, slog.New(slog.DiscardHandler)).srv.Handler)
	defer tokened.Close()
	req, _ := http.NewRequest(http.MethodGet, tokened.URL+"/dedup/v1/objects/x", nil)
	req.Host = "peer.internal:7070" // behind a balancer or a name of the operator's
	req.Header.Set("Authorization", "Bearer s3cret")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("with the token, Host %q: %d, want 200", req.Host, resp.StatusCode)
	}
}
