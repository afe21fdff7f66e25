package loadgen

import (
	"os"
	"syscall"
	"testing"
)

// TestProcessUsageCountsFaults: touching fresh anonymous pages shows as
// that many minor faults at least, as the compare tables report them.
func TestProcessUsageCountsFaults(t *testing.T) {
	const pages = 2048
	size := pages * os.Getpagesize()
	mem, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(mem)
	// Huge pages (transparent_hugepage=always) would take the region in a
	// few faults.
	const madvNoHugePage = 15
	if err := syscall.Madvise(mem, madvNoHugePage); err != nil {
		t.Logf("madvise(MADV_NOHUGEPAGE): %v", err)
	}
	before, err := ProcessUsage(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < size; i += os.Getpagesize() {
		mem[i] = 1
	}
	after, err := ProcessUsage(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if got := after.MinorFaults - before.MinorFaults; got < pages {
		t.Errorf("touching %d fresh pages counted %d minor faults", pages, got)
	}
	if after.CPU < before.CPU {
		t.Errorf("CPU went back: %v, then %v", before.CPU, after.CPU)
	}
	if _, err := ProcessUsage(-1); err == nil {
		t.Error("ProcessUsage(-1): no error")
	}
}
