package dedup

import (
	"testing"
	"time"
)

// TestDayCountsSendAgainUntilAdded: a batch whose fate is unknown is taken
// again as it was, under the same id, before any newer counts; once added,
// the newer counts leave under a new id.
func TestDayCountsSendAgainUntilAdded(t *testing.T) {
	var c DayCounts
	if _, ok := c.take(time.Now()); ok {
		t.Fatal("a batch of nothing")
	}
	c.Record(CacheMiss, 0, 0)
	c.Record(CacheHit, 100, 7)
	now := time.Date(2026, 12, 5, 23, 59, 59, 0, time.UTC)
	first, ok := c.take(now)
	if !ok || first.Counts != [6]int64{1, 0, 1, 0, 100, 7} || !first.Day.Equal(time.Date(2026, 12, 5, 0, 0, 0, 0, time.UTC)) || first.ID == "" {
		t.Fatalf("first batch: %+v", first)
	}
	c.settle(false)
	c.Record(CacheMiss, 0, 0)
	again, _ := c.take(now.Add(time.Minute)) // the next day: the batch keeps its own
	if again != first {
		t.Fatalf("sent again: %+v, want the first batch as it was: %+v", again, first)
	}
	c.settle(true)
	next, ok := c.take(now.Add(time.Minute))
	if !ok || next.ID == first.ID || next.Counts != [6]int64{0, 0, 1, 0, 0, 0} || !next.Day.Equal(time.Date(2026, 12, 6, 0, 0, 0, 0, time.UTC)) {
		t.Fatalf("after it was added: %+v", next)
	}
}
