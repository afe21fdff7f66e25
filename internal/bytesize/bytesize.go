// Package bytesize is a byte count that reads and writes as "8MiB" in YAML.
package bytesize

import (
	"fmt"
	"strconv"
	"strings"
)

// Size is a number of bytes. In YAML it is an integer (bytes) or a string
// with a unit: B, KB/MB/GB (powers of 1000) or KiB/MiB/GiB (powers of 1024).
type Size int64

const (
	KiB Size = 1 << 10
	MiB Size = 1 << 20
	GiB Size = 1 << 30
)

var units = []struct {
	suffix string
	mult   Size
}{
	// Longest suffixes first so "MiB" is not read as "B".
	{"KiB", KiB}, {"MiB", MiB}, {"GiB", GiB},
	{"KB", 1000}, {"MB", 1000 * 1000}, {"GB", 1000 * 1000 * 1000},
	{"B", 1},
}

// Parse reads "8MiB", "512KB", "1048576" or "64 KiB".
func Parse(s string) (Size, error) {
	t := strings.TrimSpace(s)
	mult := Size(1)
	for _, u := range units {
		if strings.HasSuffix(t, u.suffix) {
			t = strings.TrimSpace(strings.TrimSuffix(t, u.suffix))
			mult = u.mult
			break
		}
	}
	n, err := strconv.ParseInt(t, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("invalid size %q: want a byte count like 8MiB, 512KB or 1048576", s)
	}
	if n > int64((1<<62)/mult) {
		return 0, fmt.Errorf("size %q is too large", s)
	}
	return Size(n) * mult, nil
}

// String prints the size with the largest binary unit that divides it.
func (s Size) String() string {
	for _, u := range []struct {
		suffix string
		mult   Size
	}{{"GiB", GiB}, {"MiB", MiB}, {"KiB", KiB}} {
		if s != 0 && s%u.mult == 0 {
			return strconv.FormatInt(int64(s/u.mult), 10) + u.suffix
		}
	}
	return strconv.FormatInt(int64(s), 10) + "B"
}

// UnmarshalText implements encoding.TextUnmarshaler (YAML, env overrides).
func (s *Size) UnmarshalText(b []byte) error {
	v, err := Parse(string(b))
	if err != nil {
		return err
	}
	*s = v
	return nil
}

// MarshalText implements encoding.TextMarshaler.
func (s Size) MarshalText() ([]byte, error) { return []byte(s.String()), nil }
