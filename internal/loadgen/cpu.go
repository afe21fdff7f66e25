package loadgen

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// clockTick is Linux's USER_HZ, the unit of /proc/<pid>/stat's CPU times:
// 100 on every architecture Go runs on.
const clockTick = 10 * time.Millisecond

// Usage is what a process has used so far, from /proc/<pid>/stat (Linux).
// Comparing two readings around a load gives what a proxy spent on it.
type Usage struct {
	CPU time.Duration // user and system
	// MinorFaults counts the pages the kernel handed the process on first
	// touch. A cache that fills touches fresh pages, and where a fault is
	// dear (in some VMs it costs 10 µs or more) they can weigh as much as
	// the requests' own work; showing them says which of the two a CPU
	// figure measures.
	MinorFaults int64
}

// ProcessUsage reads process pid's Usage.
func ProcessUsage(pid int) (Usage, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return Usage{}, fmt.Errorf("process usage: %w", err)
	}
	u, err := parseStat(string(b))
	if err != nil {
		return Usage{}, fmt.Errorf("process usage: /proc/%d/stat: %w", pid, err)
	}
	return u, nil
}

// parseStat reads a /proc/<pid>/stat line (proc(5)).
func parseStat(s string) (Usage, error) {
	// The command name (field 2) may hold spaces and parentheses: fields
	// count from the last ')'.
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return Usage{}, fmt.Errorf("no command name in %q", s)
	}
	f := strings.Fields(s[i+1:])
	// After the name: state(3) ... minflt(10) ... utime(14) stime(15),
	// so f[7], f[11] and f[12].
	if len(f) < 13 {
		return Usage{}, fmt.Errorf("%d fields after the command name, want at least 13", len(f))
	}
	var v [3]int64
	for j, k := range []int{7, 11, 12} {
		n, err := strconv.ParseInt(f[k], 10, 64)
		if err != nil {
			return Usage{}, fmt.Errorf("field %d: %w", k+3, err)
		}
		v[j] = n
	}
	return Usage{CPU: time.Duration(v[1]+v[2]) * clockTick, MinorFaults: v[0]}, nil
}
