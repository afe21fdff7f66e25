package mitm

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestUnwritableCADir: a certs directory the proxy may read but not write (a read-only volume, a directory another
// user owns) and that holds no CA yet must fail start-up with a message that says so. LoadOrCreate used to spin on
// the failing mkdir of its creation lock, at full CPU and forever: it never reached its own deadline.
func TestUnwritableCADir(t *testing.T) {
	dir := t.TempDir()
	// The parent is t.TempDir's own 0700 directory; the process we pretend to be must be able to look inside.
	for _, d := range []string{filepath.Dir(dir), dir} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(dir, 0o555); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Chmod(dir, 0o755) })

	type result struct {
		err  error
		skip string
	}
	done := make(chan result, 1)
	go func() {
		// Never unlocked: the thread, whose file-system identity may change below, ends with this goroutine.
		runtime.LockOSThread()
		if os.Geteuid() == 0 {
			// Root ignores permission bits. A file-system uid other than 0 drops that privilege, for this
			// thread only, so the rest of the test binary keeps running as root.
			syscall.RawSyscall(syscall.SYS_SETFSUID, 65534, 0, 0)
		}
		if err := os.Mkdir(filepath.Join(dir, "probe"), 0o700); err == nil {
			done <- result{skip: "cannot make a directory unwritable for this process"}
			return
		}
		a, err := LoadOrCreate(Config{CADir: dir}, nil)
		if err == nil {
			a.Close()
		}
		done <- result{err: err}
	}()

	select {
	case r := <-done:
		if r.skip != "" {
			t.Skip(r.skip)
		}
		if r.err == nil {
			t.Fatal("LoadOrCreate succeeded in an unwritable directory")
		}
		if !errors.Is(r.err, fs.ErrPermission) || !strings.Contains(r.err.Error(), dir) ||
			!strings.Contains(r.err.Error(), "writable") {
			t.Errorf("error %q\nshould wrap the permission error, name %s and say it must be writable", r.err, dir)
		}
	case <-time.After(creationWait + 30*time.Second):
		t.Fatalf("LoadOrCreate still running after %s in an unwritable directory", creationWait+30*time.Second)
	}
}
