package upstream_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestConcurrentRotateRequestReload: requests, 429s with rotations,
// admin rotations, refreshes and reloads all at once (run with -race).
func TestConcurrentRotateRequestReload(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 3})
	o := newOrigin(t, false)
	o.setBehave(func(ip string, w http.ResponseWriter, r *http.Request) bool {
		if strings.HasSuffix(r.URL.Path, "/429") {
			http.Error(w, "slow", http.StatusTooManyRequests)
			return true
		}
		return false
	})
	logger, _ := testLogger(t)
	cfg := providerConfig(fp)
	cfg.Health = upstream.HealthConfig{URL: o.URL + "/ip", Interval: 10 * time.Millisecond, Timeout: time.Second}
	p := newPool(t, cfg, logger)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- p.Run(ctx) }()
	deadline := time.Now().Add(1500 * time.Millisecond)
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Go(func() {
			for j := 0; time.Now().Before(deadline); j++ {
				path := "/ok"
				if j%3 == 0 {
					path = "/429"
				}
				send(t, p, http.MethodGet, o.URL+path, clientinfo.Info{Session: fmt.Sprintf("s%d", 1+(i+j)%3), Key: fmt.Sprint(j)}, "")
			}
		})
	}
	wg.Go(func() {
		for i := 0; time.Now().Before(deadline); i++ {
			p.Rotate(context.Background(), fmt.Sprintf("s%d", 1+i%3))
		}
	})
	wg.Go(func() {
		for i := 0; time.Now().Before(deadline); i++ {
			c := cfg
			c.Rules = []upstream.RuleConfig{{Host: "127.0.0.1", Sticky: []string{"host", "none"}[i%2]}}
			if i%3 == 0 {
				c.Provider.APIKey = fp.APIKey()                         // same API
				c.Provider.Timeout = time.Duration(5+i%2) * time.Second // a new client, continuing
				c.Provider.Protocol = []string{"http", "socks5"}[i%2]
			}
			if err := p.Reconfigure(c); err != nil {
				t.Error(err)
				return
			}
			upstream.RefreshNow(context.Background(), p)
			p.Sessions()
			p.Providers()
			time.Sleep(5 * time.Millisecond)
		}
	})
	wg.Wait()
	cancel()
	<-done
}
