package upstream_test

import (
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestFirstListRetryAfterCapped: a provider API that refuses the first
// session list with 429 and Retry-After: 3600 left the pool without a
// session, answering 503 to every request, for the whole hour, and nothing
// but the log line at start-up said until when. While a provider has no
// list at all, its Retry-After holds for a minute at most
// (upstream.MaxFirstListWait); the wait and the time left are in the
// provider's status and in the 503's reason and Retry-After.
func TestFirstListRetryAfterCapped(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2, APIRetryAfter: 3600})
	fp.SetAPIMode(fakeprovider.API429)
	logger, logs := testLogger(t)
	p := newPool(t, providerConfig(fp), logger)
	start := time.Now()
	var now atomic.Int64
	now.Store(start.UnixNano())
	upstream.SetClock(p, func() time.Time { return time.Unix(0, now.Load()) })

	if !strings.Contains(logs.String(), "retry_after=1h0m0s") || !strings.Contains(logs.String(), "next_try=1m0s") {
		t.Errorf("the start-up log does not say the API asked for 1h and is asked again in 1m:\n%s", logs.String())
	}
	pv := p.Providers()[0]
	if pv.Refresh == nil || pv.Refresh.NextTry.After(start.Add(upstream.MaxFirstListWait)) || pv.Refresh.NextTryIn == "" {
		t.Errorf("provider status %+v, want the next try within %s and the time left", pv.Refresh, upstream.MaxFirstListWait)
	}
	r, err := send(t, p, http.MethodGet, "http://origin.invalid/", clientinfo.Info{}, "")
	if err == nil || r.status != 0 {
		t.Fatalf("a request with no sessions: %+v, %v; want an error", r, err)
	}
	var ex *upstream.ExhaustedError
	if !errors.As(err, &ex) || !strings.Contains(ex.Reason, "next try in") || ex.NextReady <= 0 || ex.NextReady > upstream.MaxFirstListWait {
		t.Errorf("no sessions yet: %v, want the time to the next try (at most %s) in the reason and as Retry-After", err, upstream.MaxFirstListWait)
	}

	// Ten minutes on, the API answers again: the pool has asked it, and
	// serves. Honoured whole, the hour would still run.
	fp.SetAPIMode(fakeprovider.APIOK)
	now.Store(start.Add(10 * time.Minute).UnixNano())
	runPool(t, p)
	testkit.Eventually(t, testkit.Patience, func() bool { return len(p.Sessions()) == 2 }, "the session list, ten minutes after a Retry-After of an hour")
}

// TestNoRetryAfterLoggedWhenNoneWasSent: a failed list without a
// Retry-After logs none; "retry_after=0s" read as if the API had asked to
// be called again at once.
func TestNoRetryAfterLoggedWhenNoneWasSent(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 2})
	fp.SetAPIMode(fakeprovider.API500)
	logger, logs := testLogger(t)
	newPool(t, providerConfig(fp), logger)
	if !strings.Contains(logs.String(), "upstream provider API failed at start-up") {
		t.Fatalf("no start-up failure logged:\n%s", logs.String())
	}
	if strings.Contains(logs.String(), "retry_after") {
		t.Errorf("a wait the API never asked for was logged:\n%s", logs.String())
	}
}
