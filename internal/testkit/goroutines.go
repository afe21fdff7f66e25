package testkit

import "runtime/metrics"

// GoroutinesStarted is how many goroutines the process has started since
// it began: the difference over a stretch of work counts the goroutines
// that work started, each a stack that may grow and a wake-up.
func GoroutinesStarted() uint64 {
	s := []metrics.Sample{{Name: "/sched/goroutines-created:goroutines"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}
