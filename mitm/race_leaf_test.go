package mitm

import (
	"fmt"
	"sync"
	"testing"
)

// TestConcurrentLeafStatsClose: handshakes for many hosts, under eviction pressure, while Stats is read and
// the Authority is closed, must neither race nor fail.
func TestConcurrentLeafStatsClose(t *testing.T) {
	a := newTestAuthority(t, Config{CacheSize: 4}, nil)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 200 {
				host := fmt.Sprintf("h%d.test", (g*7+i)%23)
				c, err := a.Leaf(t.Context(), host)
				if err != nil {
					t.Error(err)
					return
				}
				if c.Leaf.DNSNames[0] != host {
					t.Errorf("Leaf(%q) = cert for %q", host, c.Leaf.DNSNames)
					return
				}
				_ = a.Stats()
				if g == 0 && i == 100 {
					a.Close()
				}
			}
		})
	}
	wg.Wait()
}
