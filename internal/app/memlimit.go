package app

import (
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strings"

	"github.com/KimMachineGun/automemlimit/memlimit"

	"github.com/seed-a3c387e8/onceproxy/internal/bytesize"
)

// ProcessConfig is the `process:` section: settings of the process as a
// whole rather than of one part.
type ProcessConfig struct {
	// MemoryLimit is Go's soft memory limit (the garbage collector works
	// harder as the process nears it). Without one the heap grows to twice
	// the live set before a collection: a cache bounded at 256 MiB peaked
	// at 651 MB of RSS, and a container sized from the configuration is
	// OOM-killed. "auto" (default): 90% of the container's cgroup limit when
	// there is one, else the configured memory bounds plus a margin; "off":
	// none; or a size ("1GiB").
	MemoryLimit MemoryLimit `yaml:"memory_limit"`
}

// MemoryLimit is "auto", "off" or a byte size.
type MemoryLimit struct {
	Auto, Off bool
	Size      bytesize.Size
}

// UnmarshalText implements encoding.TextUnmarshaler.
func (m *MemoryLimit) UnmarshalText(b []byte) error {
	switch s := strings.TrimSpace(string(b)); s {
	case "", "auto":
		*m = MemoryLimit{Auto: true}
	case "off":
		*m = MemoryLimit{Off: true}
	default:
		n, err := bytesize.Parse(s)
		if err != nil {
			return fmt.Errorf("want auto, off or a size: %w", err)
		}
		*m = MemoryLimit{Size: n}
	}
	return nil
}

// MarshalText implements encoding.TextMarshaler.
func (m MemoryLimit) MarshalText() ([]byte, error) {
	switch {
	case m.Off:
		return []byte("off"), nil
	case m.Auto || m.Size == 0:
		return []byte("auto"), nil
	}
	return m.Size.MarshalText()
}

// cgroupShare is the part of a container's memory limit given to the Go
// runtime: the rest is the binary, kernel buffers and what Go does not see.
const cgroupShare = 0.9

// configuredBytes is the memory the configuration bounds: the memory cache,
// the flights' spools, and the certificate cache (a leaf and its key are
// about 4 KiB).
func configuredBytes(cfg *Config) int64 {
	return int64(cfg.Dedup.Memory.MaxBytes) + int64(cfg.Dedup.SpoolMemoryBytes) + int64(cfg.MITM.CacheSize)*4<<10
}

// memoryLimit decides the limit and says where it came from; 0 means none.
// cgroup reads the container's limit (memlimit.FromCgroup; a seam for
// tests).
func memoryLimit(cfg *Config, getenv func(string) string, cgroup func() (uint64, error)) (int64, string) {
	m := cfg.Process.MemoryLimit
	switch {
	case getenv("GOMEMLIMIT") != "":
		// The operator's explicit choice for the Go runtime wins.
		return 0, "GOMEMLIMIT in the environment"
	case m.Off:
		return 0, "process.memory_limit: off"
	case m.Size > 0:
		return int64(m.Size), "process.memory_limit"
	}
	if n, err := cgroup(); err == nil && n > 0 {
		return int64(float64(n) * cgroupShare), fmt.Sprintf("%.0f%% of the cgroup limit (%s)", cgroupShare*100, bytesize.Size(n))
	} else if err != nil && !errors.Is(err, memlimit.ErrNoCgroup) && !errors.Is(err, memlimit.ErrNoLimit) {
		slog.Debug("could not read the cgroup memory limit", "err", err)
	}
	total := configuredBytes(cfg)
	return total + max(64<<20, total/8), fmt.Sprintf("the configured bounds (%s) plus a margin", bytesize.Size(total))
}

// ApplyMemoryLimit sets the process's Go memory limit from cfg and logs it.
// It is process-wide, so main calls it, not Build.
func ApplyMemoryLimit(cfg *Config, getenv func(string) string, logger *slog.Logger) {
	limit, source := memoryLimit(cfg, getenv, memlimit.FromCgroup)
	if limit <= 0 {
		logger.Info("no Go memory limit set by onceproxy", "because", source)
		return
	}
	debug.SetMemoryLimit(limit)
	logger.Info("Go memory limit", "limit", bytesize.Size(limit).String(), "from", source)
}
