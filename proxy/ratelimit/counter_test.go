package ratelimit_test

import (
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/countertest"
	"github.com/seed-a3c387e8/onceproxy/proxy/ratelimit"
)

// TestMemoryCounterContract: the counter of one process keeps the
// contract the fleet's stores keep.
func TestMemoryCounterContract(t *testing.T) {
	c := ratelimit.NewMemoryCounter()
	defer c.Close()
	countertest.Agree(t, c, c)
}
