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

// ProcessCPU returns the CPU time (user and system) process pid has used,
// from /proc (Linux). Comparing two readings around a load gives the CPU a
// proxy spent on it.
func ProcessCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("process cpu: %w", err)
	}
	// The command name (field 2) may hold spaces: fields count from the
	// last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("process cpu: malformed /proc/%d/stat", pid)
	}
	f := strings.Fields(s[i+1:])
	// After the name: state(3) ... utime(14) stime(15), so f[11], f[12].
	if len(f) < 13 {
		return 0, fmt.Errorf("process cpu: short /proc/%d/stat", pid)
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("process cpu: malformed /proc/%d/stat", pid)
	}
	return time.Duration(ut+st) * clockTick, nil
}
