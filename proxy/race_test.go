//go:build race

package proxy_test

// raceEnabled: this test binary runs under the race detector.
const raceEnabled = true
