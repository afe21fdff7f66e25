package upstream_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// staleStore is a fleet store whose every binding names a session this
// instance has not listed (another instance refreshed its provider first).
type staleStore struct{ memBindings }

func (*staleStore) Bind(context.Context, string, string, time.Duration) (string, error) {
	return "s9", nil
}

// TestStaleBindingDoesNotWaitOnAHungAPI: a sticky request whose fleet
// binding names a session unknown here makes the pool fetch the provider's
// list on the request's path (refreshSoon). With the provider API hanging,
// the request waits at most bindingFetchWait for it, not the API's whole
// timeout, before it goes to a session that can take it.
func TestStaleBindingDoesNotWaitOnAHungAPI(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	o := newOrigin(t, false)
	cfg := providerConfig(fp)
	cfg.Provider.Timeout = 2 * time.Second
	logger, _ := testLogger(t)
	p, err := upstream.New(cfg, logger, upstream.WithBus(&staleStore{memBindings{m: map[string]string{}}}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	fp.SetAPIMode(fakeprovider.APIHang)
	t.Cleanup(func() { fp.SetAPIMode(fakeprovider.APIOK) })
	start := time.Now()
	r := mustGet(t, p, o.URL, clientinfo.Info{Account: "alice", Session: "crawl-1"})
	took := time.Since(start)
	if r.status != http.StatusOK {
		t.Fatalf("status %d", r.status)
	}
	if took > time.Second {
		t.Errorf("a sticky request waited %v on the hung provider API before it was sent", took)
	}
}
