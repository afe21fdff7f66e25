package loadgen

import (
	"testing"
	"time"
)

func TestParseStat(t *testing.T) {
	// A command name with a space and a ')' of its own; minflt 4242,
	// utime 150 and stime 25 ticks.
	line := "4021 (a b) c) S 1 4021 4021 0 -1 4194560 4242 0 7 0 150 25 0 0 20 0 3 0 1234 5678 90 18446744073709551615\n"
	u, err := parseStat(line)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Usage{CPU: 1750 * time.Millisecond, MinorFaults: 4242}); u != want {
		t.Errorf("parseStat = %+v, want %+v", u, want)
	}
	for _, bad := range []string{
		"",
		"4021 (name S 1 2",    // no ')'
		"4021 (name) S 1 2 3", // short
		"4021 (n) S 1 4021 4021 0 -1 0 x 0 0 0 1 1", // minflt not a number
	} {
		if _, err := parseStat(bad); err == nil {
			t.Errorf("parseStat(%q): no error", bad)
		}
	}
}
