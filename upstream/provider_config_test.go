package upstream_test

import (
	"strings"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestProviderConfigRefusedAtStart: a provider named "sessions" would
// take the name of the hand-listed sessions' group (their sessions then
// followed the provider, and after a reload the group took the provider's
// list, shadowing its refreshes); an api URL with a query or a fragment
// had "/api/session" appended to the query. Both stop start-up, naming
// the key.
func TestProviderConfigRefusedAtStart(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  upstream.Config
		want string
	}{
		{"shorthand named sessions", upstream.Config{Provider: upstream.ProviderConfig{Name: "sessions", API: "https://api.example", APIKey: "k"}},
			`provider.name: "sessions" names the group of hand-listed sessions`},
		{"listed provider named sessions", upstream.Config{Providers: []upstream.ProviderConfig{{Name: "sessions", API: "https://api.example", APIKey: "k"}}},
			`providers[0].name: "sessions" names the group of hand-listed sessions`},
		{"api with a query", upstream.Config{Provider: upstream.ProviderConfig{API: "https://api.example/?account=7", APIKey: "k"}},
			"provider.api: must be an http(s) URL with a host and no credentials, query or fragment"},
		{"api with a fragment", upstream.Config{Providers: []upstream.ProviderConfig{{Name: "p", API: "https://api.example/v2#x", APIKey: "k"}}},
			"providers[0].api: must be an http(s) URL with a host and no credentials, query or fragment"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate(func(string) string { return "" })
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate: %v, want %q", err, tc.want)
			}
		})
	}
	ok := upstream.Config{Providers: []upstream.ProviderConfig{{Name: "sessions2", API: "https://api.example/v2", APIKey: "k"}}}
	if err := ok.Validate(nil); err != nil {
		t.Fatalf("valid config refused: %v", err)
	}
}
