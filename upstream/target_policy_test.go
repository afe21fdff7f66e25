package upstream_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/httpstatus"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestPolicyBlockedTargetBenchesNoSession: providers refuse some targets
// by policy (domains they do not serve, ports they close), through every
// session alike: a 403 to CONNECT, a SOCKS5 "connection not allowed by
// ruleset". That refusal was a connection error of the session: one
// request to such a target benched each session it was tried on (up to
// retry.max_attempts of them) for five minutes, at every site, and a
// client asking for it now and then took the whole pool out, everyone
// else's requests answered 503. It is the target's answer, as a
// gateway's "cannot reach the target" is: tried on one other session,
// answered 502 with the gateway's reason, and charged to no session
// unless another one reaches the target.
func TestPolicyBlockedTargetBenchesNoSession(t *testing.T) {
	for _, proto := range []string{"http", "socks5"} {
		t.Run(proto, func(t *testing.T) {
			fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 3})
			o := newOrigin(t, true)
			blocked := newOrigin(t, true)
			target := strings.TrimPrefix(blocked.URL, "https://")
			fp.Block(target)
			cfg := providerConfig(fp)
			cfg.Provider.Protocol = proto
			cfg.CAFiles = []string{originCAFile(t, o.Server), originCAFile(t, blocked.Server)}
			logger, _ := testLogger(t)
			p := newPool(t, cfg, logger)
			checkNoneBenched := func(what string) {
				t.Helper()
				for _, s := range p.Sessions() {
					if !s.Available {
						t.Errorf("%s: session %s benched: %+v", what, s.ID, s)
					}
				}
			}

			_, err := send(t, p, http.MethodGet, blocked.URL, clientinfo.Info{}, "")
			if st, _ := httpstatus.Of(err); err == nil || st != http.StatusBadGateway || errors.Is(err, upstream.ErrExhausted) {
				t.Fatalf("GET a blocked target: err = %v (status %d), want a 502 with the gateway's reason", err, st)
			}
			checkNoneBenched("after a request")

			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			c, err := p.DialContext(ctx, "tcp", target)
			if err == nil {
				c.Close()
				t.Fatal("tunnel to a blocked target opened")
			}
			if st, _ := httpstatus.Of(err); st != http.StatusBadGateway {
				t.Fatalf("tunnel to a blocked target: err = %v (status %d), want a 502", err, st)
			}
			checkNoneBenched("after a tunnel")
			if r := mustGet(t, p, o.URL, clientinfo.Info{}); r.status != 200 {
				t.Fatalf("another origin afterwards: %+v", r)
			}
		})
	}
}
