package app

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"runtime/debug"
	"strconv"
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
	// GCPercent is the collector's GOGC: how far the heap grows past the
	// live set before a collection. A proxy allocates per request and
	// keeps a small live set, so Go's 100 collects often: at 100 the
	// collector took a sixth of a cache hit's CPU. With a memory limit in
	// force the limit, not GOGC, bounds the heap, and a higher GOGC only
	// collects less often below it. "auto" (default): 400 while a memory
	// limit is in force (memory_limit, or GOMEMLIMIT), else Go's 100; or a
	// number from 25 to 10000. A GOGC environment variable wins over all.
	GCPercent GCPercent `yaml:"gc_percent"`
}

// GCPercent is "auto" (N 0) or a GOGC value.
type GCPercent struct {
	N int
}

// minGCPercent and maxGCPercent bound a configured GCPercent: below 25
// the collector runs nearly all the time; above 10000 only the memory
// limit stops the heap.
const (
	minGCPercent = 25
	maxGCPercent = 10000
	// limitedGCPercent is auto's GOGC under a memory limit. Measured with
	// onceload -compare-hits (100 hot keys, c=64): 0.80-0.89x of direct's
	// req/s at 100, 0.90-0.99x at 400; unique misses (-compare, HTTP/1.1)
	// 13-15% less CPU per request.
	limitedGCPercent = 400
)

// UnmarshalText implements encoding.TextUnmarshaler.
func (g *GCPercent) UnmarshalText(b []byte) error {
	s := strings.TrimSpace(string(b))
	if s == "" || s == "auto" {
		*g = GCPercent{}
		return nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < minGCPercent || n > maxGCPercent {
		// No key in the message: the loader names it (line and key in the
		// file, the variable in an override).
		return fmt.Errorf("want auto or a number from %d to %d, got %q", minGCPercent, maxGCPercent, s)
	}
	*g = GCPercent{N: n}
	return nil
}

// MarshalText implements encoding.TextMarshaler.
func (g GCPercent) MarshalText() ([]byte, error) {
	if g.N == 0 {
		return []byte("auto"), nil
	}
	return []byte(strconv.Itoa(g.N)), nil
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
		if n == 0 {
			// A size of 0 is what MemoryLimit holds for auto: it would
			// run under auto's limit, not without one.
			return fmt.Errorf("want auto, off or a size, got %q: for no limit, write off", s)
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

// minMemoryHeadroom is what a configured memory limit must leave above
// the memory cache's bound for everything else: the runtime, goroutine
// stacks, connection buffers. A limit below it (512,
// meaning bytes) is accepted by the runtime and makes the collector run
// without end.
const minMemoryHeadroom = 32 << 20

// cgroupShare is the part of a container's memory limit given to the Go
// runtime: the rest is the binary, kernel buffers and what Go does not see.
const cgroupShare = 0.9

// configuredBytes is the memory the configuration bounds: the memory cache,
// the flights' spools, and the certificate cache (a leaf and its key are
// about 4 KiB).
func configuredBytes(cfg *Config) int64 {
	certs := int64(math.MaxInt64)
	if n := int64(cfg.MITM.CacheSize); n <= math.MaxInt64>>12 {
		certs = n * 4 << 10
	}
	return addBounded(addBounded(int64(cfg.Dedup.Memory.MaxBytes), int64(cfg.Dedup.SpoolMemoryBytes)), certs)
}

// addBounded is a + b for byte counts that are not negative, held at the
// int64 maximum: a sum that wrapped round would be a tiny or negative
// memory limit under which the collector never stops.
func addBounded(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
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
	return addBounded(total, max(64<<20, total/8)), fmt.Sprintf("the configured bounds (%s) plus a margin", bytesize.Size(total))
}

// gcPercent decides the collector's GOGC and says where it came from; 0
// leaves Go's own. limited says whether a memory limit is in force.
func gcPercent(cfg *Config, getenv func(string) string, limited bool) (int, string) {
	g := cfg.Process.GCPercent
	switch {
	case getenv("GOGC") != "":
		return 0, "GOGC in the environment"
	case g.N > 0:
		return g.N, "process.gc_percent"
	case limited:
		return limitedGCPercent, "process.gc_percent: auto, under the memory limit"
	}
	return 0, "process.gc_percent: auto, without a memory limit"
}

// ApplyRuntime sets the process's Go memory limit and the collector's
// GOGC from cfg, and logs them. They are process-wide, so main calls it,
// not Build.
func ApplyRuntime(cfg *Config, getenv func(string) string, logger *slog.Logger) {
	limit, source := memoryLimit(cfg, getenv, memlimit.FromCgroup)
	if limit > 0 {
		debug.SetMemoryLimit(limit)
		logger.Info("Go memory limit", "limit", bytesize.Size(limit).String(), "from", source)
	} else {
		logger.Info("no Go memory limit set by onceproxy", "because", source)
	}
	// In force: the one just set, or the runtime's own from GOMEMLIMIT.
	limited := debug.SetMemoryLimit(-1) < math.MaxInt64
	gc, from := gcPercent(cfg, getenv, limited)
	if gc > 0 {
		debug.SetGCPercent(gc)
		logger.Info("Go GC percent", "gogc", gc, "from", from)
	}
}
