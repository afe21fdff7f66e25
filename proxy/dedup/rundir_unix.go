//go:build unix

package dedup

import (
	"errors"
	"os"
	"syscall"
)

// nameLocked renames the locked directory tmp to path. The lock is on the
// open file: it moves with the directory.
func nameLocked(tmp, path string, lock *os.File) (*os.File, error) {
	return lock, os.Rename(tmp, path)
}

func lockFile(f *os.File) error {
	return syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
}

// lockedByAnother reports whether a live process holds the lock at path.
// A lock that cannot be checked counts as held: removing a live process's
// files would fail its downloads.
func lockedByAnother(path string) bool {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if errors.Is(err, os.ErrNotExist) {
		return false
	}
	if err != nil {
		return true
	}
	defer f.Close()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return true
	}
	syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	return false
}
