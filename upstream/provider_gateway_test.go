package upstream

import (
	"strings"
	"testing"
)

// TestCheckGatewayHost: a provider API on a public host cannot point the
// proxy at a gateway on loopback, a private network, link-local (cloud
// metadata) or any other non-public address, in any spelling; a provider
// on an internal network may. Nothing is dialled or resolved.
func TestCheckGatewayHost(t *testing.T) {
	for _, tc := range []struct {
		api, gateway string
		refused      bool
	}{
		{"api.provider.example", "gw.provider.example", false},
		{"api.provider.example", "1.1.1.1", false},
		{"api.provider.example", "8.8.8.8", false},
		{"api.provider.example", "127.0.0.1", true},
		{"api.provider.example", "2130706433", true}, // 127.0.0.1 as one number
		{"api.provider.example", "localhost", true},
		{"api.provider.example", "gw.localhost", true},
		{"api.provider.example", "10.1.2.3", true},
		{"api.provider.example", "169.254.169.254", true},
		{"api.provider.example", "::1", true},
		{"api.provider.example", "::ffff:192.168.0.1", true},
		{"8.8.8.8", "192.168.1.10", true},
		// A provider on an internal network names gateways there.
		{"10.0.0.5", "10.0.0.6", false},
		{"127.0.0.1", "127.0.0.1", false},
		{"localhost", "127.0.0.2", false},
	} {
		err := checkGatewayHost(tc.api, tc.gateway)
		if (err != nil) != tc.refused {
			t.Errorf("API %s, gateway %s: %v, want refused %v", tc.api, tc.gateway, err, tc.refused)
		}
		if err != nil && !strings.Contains(err.Error(), tc.gateway) {
			t.Errorf("the refusal does not name the gateway: %v", err)
		}
	}
}
