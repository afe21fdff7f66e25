package fleettest

import (
	"fmt"
	"sync"
)

// Load is steady load for an outage to fall on: workers goroutines, each
// sending its requests one after the other (the i-th of worker w is
// get(w, i)) until the stop it returns is called. stop waits for them and
// returns the X-Cache values they got, counted, and each request that
// failed or was not a 200, described.
func Load(workers int, get func(w, i int) Got) (stop func() (counts map[string]int, failed []string)) {
	var (
		mu     sync.Mutex
		counts = map[string]int{}
		errs   []string
	)
	done := make(chan struct{})
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-done:
					return
				default:
				}
				g := get(w, i)
				mu.Lock()
				if g.Err != nil || g.Status != 200 {
					errs = append(errs, fmt.Sprintf("worker %d, request %d: %+v", w, i, g))
				}
				counts[g.XCache]++
				mu.Unlock()
			}
		})
	}
	return func() (map[string]int, []string) {
		close(done)
		wg.Wait()
		return counts, errs
	}
}
