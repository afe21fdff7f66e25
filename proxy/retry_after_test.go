package proxy_test

import (
	"crypto/x509"
	"io"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestNoSessionFreeSaysWhenToRetry: while every session sits out a site
// (it answered 429 with Retry-After: 120), its requests get a 503 saying
// why, and when one will be free: Retry-After, which urllib3's Retry and
// other clients' backoff honour, instead of retrying at once into the
// same 503.
func TestNoSessionFreeSaysWhenToRetry(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 1})
	origin := tlsOrigin(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		rw.Header().Set("Retry-After", "120")
		http.Error(rw, "slow down", http.StatusTooManyRequests)
	}), false)
	w := newWorld(t, worldOpts{
		originCAs: []*x509.Certificate{origin.Certificate()},
		upstream:  upstream.Config{Provider: upstream.ProviderConfig{API: fp.APIURL(), APIKey: fp.APIKey()}},
	})
	c := w.client(false)
	get := func() *http.Response {
		t.Helper()
		resp, err := c.Get(origin.URL + "/page")
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	if resp := get(); resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("first request: %d, want the origin's 429", resp.StatusCode)
	}
	resp := get()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("while the only session sits the site out: %d, want 503", resp.StatusCode)
	}
	// The session's cooldown at the site: the origin's 120s, or 10
	// minutes once its exit IPs met the wall three times in a row (the
	// first request rotated it and tried its new IPs).
	sessions := w.up.Sessions()
	if len(sessions) != 1 || len(sessions[0].CoolingSites) != 1 {
		t.Fatalf("sessions: %+v, want the one sitting the site out", sessions)
	}
	want := int(time.Until(sessions[0].CoolingSites[0].Until).Seconds())
	n, err := strconv.Atoi(resp.Header.Get("Retry-After"))
	if err != nil || n < 100 || n < want-5 || n > want+5 {
		t.Fatalf("Retry-After %q, want the session's cooldown at the site (%ds)", resp.Header.Get("Retry-After"), want)
	}
}
