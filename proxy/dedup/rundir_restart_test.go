package dedup

import (
	"testing"
)

// TestRunDirOfAProcessRestartedAtOnceIsRemoved: a process that crashed and
// was started again within a minute (systemd's Restart=, a crash loop)
// found its predecessor's directory younger than staleAge, spared it as
// one another process might be making, and never removed it: each crash
// left up to disk.max_bytes of files behind, for good. A run directory is
// locked from the moment it has its name, so an unlocked one is a dead
// process's whatever its age.
func TestRunDirOfAProcessRestartedAtOnceIsRemoved(t *testing.T) {
	parent := t.TempDir()
	dead, err := openRunDir(parent)
	if err != nil {
		t.Fatal(err)
	}
	f, err := dead.create("obj-*")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(pattern(64 << 10)); err != nil {
		t.Fatal(err)
	}
	f.Close()
	dead.lock.Close() // the process died: its lock is free, its files stay
	next, err := openRunDir(parent)
	if err != nil {
		t.Fatal(err)
	}
	defer next.remove()
	if dirExists(dead.path) {
		t.Errorf("the crashed process's directory (%d files) outlived the restart", dead.files())
	}
}
