//go:build !unix

package dedup

import (
	"os"
	"path/filepath"
)

// Without flock, run directories are never taken for stale: files left by
// a crash stay until removed by hand.
func lockFile(*os.File) error { return nil }

// nameLocked renames the directory tmp to path. Windows renames no
// directory holding an open file, and there is no lock to keep here: the
// lock file is closed for the rename and opened again after.
func nameLocked(tmp, path string, lock *os.File) (*os.File, error) {
	lock.Close()
	if err := os.Rename(tmp, path); err != nil {
		return nil, err
	}
	return os.OpenFile(filepath.Join(path, "lock"), os.O_RDWR, 0o600)
}

func lockedByAnother(string) bool { return true }
