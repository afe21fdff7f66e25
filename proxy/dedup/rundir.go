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

// runDirPrefix starts every run directory's name; newDirPrefix a run
// directory's while it is being made, before its lock is held.
const (
	runDirPrefix = "run-"
	newDirPrefix = "new-"
)

// staleAge spares directories younger than this from the clean-up: one
// that another process is making may not be locked yet.
const staleAge = time.Minute

// openRunDir creates parent if needed, removes stale run directories in it
// and makes a fresh one.
func openRunDir(parent string) (*runDir, error) {
	if err := os.MkdirAll(parent, 0o700); err != nil {
		return nil, err
	}
	removeStale(parent)
	path, lock, err := makeLocked(parent, "")
	if err != nil {
		return nil, err
	}
	return &runDir{path: path, lock: lock}, nil
}

// makeLocked makes a run directory in parent, named path ("": a fresh
// name), with its lock held. It is made and locked under a newDirPrefix
// name, then renamed: a run directory whose lock is free is then always a
// dead process's, whatever its age, and goes at the next start. (Locked
// after it had its name, a crashed process's directory was spared for
// staleAge as one being made, and a restart within that minute left its
// files behind for good.)
func makeLocked(parent, path string) (string, *os.File, error) {
	tmp, err := os.MkdirTemp(parent, newDirPrefix)
	if err != nil {
		return "", nil, err
	}
	if path == "" {
		path = filepath.Join(parent, runDirPrefix+strings.TrimPrefix(filepath.Base(tmp), newDirPrefix))
	}
	lock, err := os.OpenFile(filepath.Join(tmp, "lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err == nil {
		if err = lockFile(lock); err == nil {
			lock, err = nameLocked(tmp, path, lock)
		}
		if err != nil && lock != nil {
			lock.Close()
		}
	}
	if err != nil {
		os.RemoveAll(tmp)
		return "", nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return path, lock, nil
}

func removeStale(parent string) {
	ents, err := os.ReadDir(parent)
	if err != nil {
		return
	}
	for _, ent := range ents {
		name := ent.Name()
		run := strings.HasPrefix(name, runDirPrefix)
		if !ent.IsDir() || !run && !strings.HasPrefix(name, newDirPrefix) {
			continue
		}
		dir := filepath.Join(parent, name)
		lock := filepath.Join(dir, "lock")
		// Young and not locked for sure yet: being made, by this version
		// (newDirPrefix) or by an older one, which named its directory
		// before it made the lock.
		if _, err := os.Stat(lock); !run || err != nil {
			if info, err := ent.Info(); err != nil || time.Since(info.ModTime()) < staleAge {
				continue
			}
		}
		if lockedByAnother(lock) {
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
	parent := filepath.Dir(d.path)
	if err := os.MkdirAll(parent, 0o700); err != nil {
		return err
	}
	if _, err := os.Stat(filepath.Join(d.path, "lock")); err == nil {
		return nil // restored by another caller before us: the lock is ours
	}
	_, lock, err := makeLocked(parent, d.path)
	if err != nil {
		return err
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
