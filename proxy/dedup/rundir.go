package dedup

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
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

	mu     sync.Mutex // protects lock and closed
	lock   *os.File   // held (flock) while the process uses path
	closed bool       // removed for good: never made again
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
// (os.CreateTemp). A directory removed under the running process (a tmp
// cleaner, an operator's rm -rf) is made again: otherwise every body that
// outgrows memory would fail, and nothing big be cached, until a restart.
func (d *runDir) create(pattern string) (*os.File, error) {
	f, err := os.CreateTemp(d.path, pattern)
	if err == nil || !errors.Is(err, fs.ErrNotExist) {
		return f, err
	}
	if rerr := d.restore(); rerr != nil {
		return nil, fmt.Errorf("%w (making the directory again: %v)", err, rerr)
	}
	return os.CreateTemp(d.path, pattern)
}

// restore makes the run directory again, with a lock of its own: without
// one, the next process to start would remove it as a crashed process's
// (removeStale).
func (d *runDir) restore() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return os.ErrClosed
	}
	if err := os.MkdirAll(d.path, 0o700); err != nil {
		return err
	}
	lockPath := filepath.Join(d.path, "lock")
	if _, err := os.Stat(lockPath); err == nil {
		return nil // restored by another caller before us: the lock is ours
	}
	lock, err := os.OpenFile(lockPath, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return err
	}
	if err := lockFile(lock); err != nil {
		lock.Close()
		return fmt.Errorf("lock %s: %w", d.path, err)
	}
	d.lock.Close() // the old lock's file is gone with its directory
	d.lock = lock
	return nil
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
	d.mu.Lock()
	d.closed = true
	lock := d.lock
	d.mu.Unlock()
	os.RemoveAll(d.path)
	lock.Close()
}
