package dedup

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// runDir is this process's own directory under a configured parent
// (spool_dir, disk.dir): spool and disk-tier files live in it, so several
// processes may share one parent, and Close removes every file at once.
// The directory holds a lock for as long as the process lives; a later
// start removes the directories whose lock nobody holds (left by a process
// that crashed).
type runDir struct {
	path string
	lock *os.File // held (flock) while the process uses path
}

// runDirPrefix starts every run directory's name.
const runDirPrefix = "run-"

// staleAge spares directories younger than this from the clean-up: one
// created by another process a moment ago may not be locked yet.
const staleAge = time.Minute

// openRunDir creates parent if needed, removes stale run directories in it
// and makes a fresh one.
func openRunDir(parent string) (*runDir, error) {
	if err := os.MkdirAll(parent, 0o700); err != nil {
		return nil, err
	}
	removeStale(parent)
	path, err := os.MkdirTemp(parent, runDirPrefix)
	if err != nil {
		return nil, err
	}
	lock, err := os.OpenFile(filepath.Join(path, "lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err == nil {
		err = lockFile(lock)
	}
	if err != nil {
		if lock != nil {
			lock.Close()
		}
		os.RemoveAll(path)
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return &runDir{path: path, lock: lock}, nil
}

func removeStale(parent string) {
	ents, err := os.ReadDir(parent)
	if err != nil {
		return
	}
	for _, ent := range ents {
		if !ent.IsDir() || !strings.HasPrefix(ent.Name(), runDirPrefix) {
			continue
		}
		dir := filepath.Join(parent, ent.Name())
		if info, err := ent.Info(); err != nil || time.Since(info.ModTime()) < staleAge {
			continue
		}
		if lockedByAnother(filepath.Join(dir, "lock")) {
			continue
		}
		os.RemoveAll(dir)
	}
}

// create makes a new file in the run directory, named after pattern
// (os.CreateTemp).
func (d *runDir) create(pattern string) (*os.File, error) {
	return os.CreateTemp(d.path, pattern)
}

// files counts the files in the run directory, the lock aside (for the
// tests: nothing else needs the count).
func (d *runDir) files() int {
	ents, err := os.ReadDir(d.path)
	if err != nil {
		return 0
	}
	n := 0
	for _, e := range ents {
		if e.Name() != "lock" {
			n++
		}
	}
	return n
}

// remove deletes the directory and everything in it. Readers that still
// have a file open keep reading it (the data goes when they close it).
func (d *runDir) remove() {
	os.RemoveAll(d.path)
	d.lock.Close()
}
