//go:build !unix

package mitm

import "time"

// lockFile takes no lock where there is no flock: instances starting
// together on one empty certs directory may each create a CA there.
func lockFile(string, time.Duration) (unlock func(), err error) { return func() {}, nil }
