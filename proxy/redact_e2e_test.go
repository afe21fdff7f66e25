package proxy_test

import (
	"crypto/x509"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestQuerySecretsNotLogged: a request that fails is logged with its URL,
// and the values of its credential-like query parameters (api_key=,
// access_token=, sig=) used to be written out in clear with it: anyone
// reading the logs (a log shipper, a support bundle) got the clients'
// API keys. They are masked, as a password in the URL is; the other
// parameters stay, for the operator to see which request failed.
func TestQuerySecretsNotLogged(t *testing.T) {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Hang up without an answer: the request fails upstream.
		c, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			c.Close()
		}
	}))
	defer origin.Close()
	tlsO := tlsOrigin(t, origin.Config.Handler, true)
	w := newWorld(t, worldOpts{originCAs: []*x509.Certificate{tlsO.Certificate()}})
	for _, base := range []string{origin.URL, tlsO.URL} {
		u := base + "/v1/items?q=shoes&api_key=SECRETKEY1&access_token=SECRETTOKEN2&sig=SECRETSIG3"
		resp, err := w.client(false).Get(u)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode < 500 {
				t.Fatalf("%s: %d, want the upstream failure", u, resp.StatusCode)
			}
		}
	}
	logs := w.logs.String()
	if !strings.Contains(logs, "request failed") || !strings.Contains(logs, "q=shoes") {
		t.Fatalf("no failure logged with its URL:\n%s", logs)
	}
	for _, secret := range []string{"SECRETKEY1", "SECRETTOKEN2", "SECRETSIG3"} {
		if strings.Contains(logs, secret) {
			t.Errorf("the log shows %s:\n%s", secret, logs)
		}
	}
}
