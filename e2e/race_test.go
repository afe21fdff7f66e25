//go:build race

package e2e

// raceEnabled: the test binary runs with the race detector, so the onceproxy
// binary under test is built with it too.
const raceEnabled = true
