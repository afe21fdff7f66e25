package app

import (
	"errors"
	"log/slog"
	"math"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/KimMachineGun/automemlimit/memlimit"
)

// envFrom is a getenv over environ, as main builds its own (LookupEnv).
func envFrom(environ ...string) func(string) string {
	return func(k string) string { return LookupEnv(environ, k) }
}

// loadYAML loads the shipped configuration under yaml, or fails t.
func loadYAML(t *testing.T, yaml string) *Config {
	t.Helper()
	cfg, err := LoadConfig(shippedConfig, writeConfig(t, yaml), nil)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

func TestMemoryLimit(t *testing.T) {
	noCgroup := func() (uint64, error) { return 0, memlimit.ErrNoCgroup }
	none := func(string) string { return "" }
	cfg := loadYAML(t, "dedup: {memory: {max_bytes: 256MiB}, spool_memory_bytes: 128MiB}\n")
	limit, from := memoryLimit(cfg, none, noCgroup)
	// 256 MiB of cache + 128 MiB of spools + 10,000 certificates at 4 KiB,
	// plus a margin of 64 MiB (an eighth of the bounds is less): under 1.2x
	// the bounds.
	total := int64(256<<20 + 128<<20 + 10000*4<<10)
	if limit != total+64<<20 || !strings.Contains(from, "configured bounds") {
		t.Errorf("derived limit %d (%s), want %d", limit, from, total+64<<20)
	}
	big := loadYAML(t, "dedup: {memory: {max_bytes: 4GiB}}\n")
	if limit, _ := memoryLimit(big, none, noCgroup); limit != configuredBytes(big)*9/8 {
		t.Errorf("large bounds get an eighth as margin: %d", limit)
	}
	inCgroup := func() (uint64, error) { return 1 << 30, nil }
	if limit, from := memoryLimit(cfg, none, inCgroup); limit != 966367641 || !strings.Contains(from, "cgroup") {
		t.Errorf("cgroup: %d (%s)", limit, from)
	}
	if limit, _ := memoryLimit(loadYAML(t, "process: {memory_limit: 2GiB}\n"), none, inCgroup); limit != 2<<30 {
		t.Errorf("configured size: %d", limit)
	}
	if limit, _ := memoryLimit(loadYAML(t, "process: {memory_limit: off}\n"), none, inCgroup); limit != 0 {
		t.Errorf("off: %d", limit)
	}
	env := envFrom("GOMEMLIMIT=300MiB")
	if limit, from := memoryLimit(cfg, env, inCgroup); limit != 0 || !strings.Contains(from, "GOMEMLIMIT") {
		t.Errorf("GOMEMLIMIT must win: %d (%s)", limit, from)
	}
	if limit, _ := memoryLimit(cfg, none, func() (uint64, error) { return 0, errors.New("unreadable") }); limit != total+64<<20 {
		t.Errorf("an unreadable cgroup falls back to the bounds: %d", limit)
	}
	c, err := LoadConfig(shippedConfig, "", []string{"ONCEPROXY_PROCESS_MEMORY_LIMIT=512MiB"})
	if err != nil || c.Process.MemoryLimit.Size != 512<<20 {
		t.Errorf("env override: %+v %v", c.Process.MemoryLimit, err)
	}
	// A size below what the configuration keeps in memory is refused at
	// start-up, naming the key and the least it could be.
	for _, small := range []string{"process: {memory_limit: 512}\n", "process: {memory_limit: 280MiB}\n"} {
		_, err := LoadConfig(shippedConfig, writeConfig(t, small), nil)
		if err == nil || !strings.Contains(err.Error(), "process.memory_limit:") || !strings.Contains(err.Error(), "at least") {
			t.Errorf("%q: %v, want process.memory_limit refused as below the configured bounds", small, err)
		}
	}
	for _, fine := range []string{"process: {memory_limit: 300MiB}\n", "process: {memory_limit: 100MiB}\ndedup: {memory: {max_bytes: 64MiB}}\n"} {
		if _, err := LoadConfig(shippedConfig, writeConfig(t, fine), nil); err != nil {
			t.Errorf("%q: %v", fine, err)
		}
	}
	for _, bad := range []string{"process: {memory_limit: lots}\n", "process: {memory_limit: -1}\n"} {
		if _, err := LoadConfig(shippedConfig, writeConfig(t, bad), nil); err == nil || !strings.Contains(err.Error(), "auto, off or a size") {
			t.Errorf("%q: %v", bad, err)
		}
	}
}

// TestMemoryLimitHugeCertCache: auto's limit adds up the configured
// bounds, and mitm.cert_cache_size × 4 KiB wrapped round int64 for a size
// near 2^52: 2^52 - 100,000 certificates came to a limit of 57 MiB under a
// 256 MiB cache, a collector running without end once the cache filled.
// Bounds past int64 are held at its maximum: no limit in effect.
func TestMemoryLimitHugeCertCache(t *testing.T) {
	noCgroup := func() (uint64, error) { return 0, memlimit.ErrNoCgroup }
	none := func(string) string { return "" }
	cfg := loadYAML(t, "mitm: {cert_cache_size: 4503599627270496}\n")
	if limit, from := memoryLimit(cfg, none, noCgroup); limit < int64(cfg.Dedup.Memory.MaxBytes) {
		t.Errorf("limit %d (%s) is below the memory cache's %d", limit, from, int64(cfg.Dedup.Memory.MaxBytes))
	}
}

// TestMemoryLimitZeroRefused: memory_limit: 0 was read as a size of none
// and the process ran under auto's limit, the opposite of what someone
// writing 0 for "no limit" asked for. It is refused, pointing at off.
func TestMemoryLimitZeroRefused(t *testing.T) {
	for _, zero := range []string{"0", "0B", "0MiB"} {
		_, err := LoadConfig(shippedConfig, writeConfig(t, "process: {memory_limit: "+zero+"}\n"), nil)
		if err == nil || !strings.Contains(err.Error(), "line 1: process.memory_limit:") || !strings.Contains(err.Error(), "off") {
			t.Errorf("memory_limit %s in a file: %v, want it refused, naming the key and off", zero, err)
		}
		_, err = LoadConfig(shippedConfig, "", []string{"ONCEPROXY_PROCESS_MEMORY_LIMIT=" + zero})
		if err == nil || !strings.Contains(err.Error(), "ONCEPROXY_PROCESS_MEMORY_LIMIT:") || !strings.Contains(err.Error(), "off") {
			t.Errorf("ONCEPROXY_PROCESS_MEMORY_LIMIT=%s: %v, want it refused, naming the variable and off", zero, err)
		}
	}
}

func TestGCPercent(t *testing.T) {
	none := func(string) string { return "" }
	shipped := loadYAML(t, "")
	if gc, from := gcPercent(shipped, none, true); gc != limitedGCPercent || !strings.Contains(from, "auto") {
		t.Errorf("auto under a memory limit: %d (%s), want %d", gc, from, limitedGCPercent)
	}
	if gc, _ := gcPercent(shipped, none, false); gc != 0 {
		t.Errorf("auto without a memory limit must leave Go's own: %d", gc)
	}
	if gc, _ := gcPercent(loadYAML(t, "process: {gc_percent: 200}\n"), none, false); gc != 200 {
		t.Errorf("configured: %d", gc)
	}
	env := envFrom("GOGC=150")
	if gc, from := gcPercent(loadYAML(t, "process: {gc_percent: 200}\n"), env, true); gc != 0 || !strings.Contains(from, "GOGC") {
		t.Errorf("GOGC must win: %d (%s)", gc, from)
	}
	c, err := LoadConfig(shippedConfig, "", []string{"ONCEPROXY_PROCESS_GC_PERCENT=800"})
	if err != nil || c.Process.GCPercent.N != 800 {
		t.Errorf("env override: %+v %v", c.Process.GCPercent, err)
	}
	for _, bad := range []string{"lots", "10", "20000", "-1", "1.5"} {
		_, err := LoadConfig(shippedConfig, writeConfig(t, "process: {gc_percent: "+bad+"}\n"), nil)
		if err == nil || !strings.Contains(err.Error(), "gc_percent") || !strings.Contains(err.Error(), "auto or a number from 25 to 10000") {
			t.Errorf("%q: %v", bad, err)
		}
	}
}

// TestApplyRuntime sets the process's memory limit and GOGC as the
// configuration says, and restores Go's afterwards.
func TestApplyRuntime(t *testing.T) {
	oldGC := debug.SetGCPercent(100)
	oldLimit := debug.SetMemoryLimit(math.MaxInt64)
	t.Cleanup(func() {
		debug.SetGCPercent(oldGC)
		debug.SetMemoryLimit(oldLimit)
	})
	none := func(string) string { return "" }
	cfg := loadYAML(t, "process: {memory_limit: 1GiB}\n")
	ApplyRuntime(cfg, none, slog.New(slog.DiscardHandler))
	if got := debug.SetMemoryLimit(-1); got != 1<<30 {
		t.Errorf("memory limit %d, want 1GiB", got)
	}
	if got := debug.SetGCPercent(100); got != limitedGCPercent {
		t.Errorf("GOGC %d, want %d", got, limitedGCPercent)
	}
	// No limit: Go's GOGC stays.
	debug.SetMemoryLimit(math.MaxInt64)
	cfg = loadYAML(t, "process: {memory_limit: off}\n")
	ApplyRuntime(cfg, none, slog.New(slog.DiscardHandler))
	if got := debug.SetGCPercent(100); got != 100 {
		t.Errorf("GOGC %d without a memory limit, want Go's 100", got)
	}
}
