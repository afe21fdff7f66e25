package upstream_test

import (
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestExhaustedSaysWhenEvenSoon: every session cooling, the client is
// answered 503 with when one is ready (Retry-After, from NextReady). With
// less than half a second left, NextReady was rounded to 0, which reads as
// "unknown": the answer had no Retry-After and its reason said "ready in
// 0s". It is rounded up, to the whole seconds Retry-After counts in.
func TestExhaustedSaysWhenEvenSoon(t *testing.T) {
	logger, _ := testLogger(t)
	p := newPool(t, upstream.Config{URL: "http://u:pw@" + testkit.DeadAddr(t)}, logger)
	start := time.Now()
	var now atomic.Int64
	now.Store(start.UnixNano())
	upstream.SetClock(p, func() time.Time { return time.Unix(0, now.Load()) })
	send(t, p, http.MethodGet, "http://127.0.0.1:9/", clientinfo.Info{}, "")
	st := statusOf(t, p, "default")
	if st.Available {
		t.Fatalf("session not cooling after a dead gateway: %+v", st)
	}
	now.Store(st.CooldownUntil.Add(-300 * time.Millisecond).UnixNano())
	_, err := send(t, p, http.MethodGet, "http://127.0.0.1:9/", clientinfo.Info{}, "")
	var ex *upstream.ExhaustedError
	if !errors.As(err, &ex) {
		t.Fatalf("err = %v, want an ExhaustedError", err)
	}
	if ex.RetryAfter() != time.Second || strings.Contains(ex.Reason, "in 0s") {
		t.Errorf("300ms before the session is ready: RetryAfter %v, reason %q; want 1s", ex.RetryAfter(), ex.Reason)
	}
}
