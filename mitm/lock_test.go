package mitm

import (
	"bytes"
	"crypto"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// startTogether starts n instances at once on dir and returns their CA PEMs and errors.
func startTogether(dir string, n int) (pems [][]byte, errs []error) {
	var (
		mu    sync.Mutex
		wg    sync.WaitGroup
		start = make(chan struct{})
	)
	for range n {
		wg.Go(func() {
			<-start
			a, err := LoadOrCreate(Config{CADir: dir}, nil)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return
			}
			pems = append(pems, a.CertPEM())
			a.Close()
		})
	}
	close(start)
	wg.Wait()
	return pems, errs
}

// checkOneCA fails if the instances disagree, or if the files on disk are not the CA they use.
func checkOneCA(t *testing.T, dir string, pems [][]byte) bool {
	t.Helper()
	for _, p := range pems[1:] {
		if !bytes.Equal(p, pems[0]) {
			t.Errorf("instances started together use different CAs")
			return false
		}
	}
	onDisk, err := os.ReadFile(filepath.Join(dir, certFileName))
	if err != nil {
		t.Error(err)
		return false
	}
	if len(pems) > 0 && !bytes.Equal(onDisk, pems[0]) {
		t.Errorf("ca.pem on disk is not the CA the instances use")
		return false
	}
	cert, err := parseCertPEM(onDisk)
	if err != nil {
		t.Error(err)
		return false
	}
	keyPEM, err := os.ReadFile(filepath.Join(dir, keyFileName))
	if err != nil {
		t.Error(err)
		return false
	}
	key, err := parseKeyPEM(keyPEM)
	if err != nil {
		t.Error(err)
		return false
	}
	if !cert.PublicKey.(interface{ Equal(crypto.PublicKey) bool }).Equal(key.Public()) {
		t.Errorf("ca.pem and ca-key.pem on disk do not match: the next start will refuse them")
		return false
	}
	return true
}

// TestStartAfterACrashedCreator: a creator that crashed leaves its lock
// file (and an older version its lock directory) behind. Instances that
// then start together on the directory all run with one CA, the one on
// disk. The lock directory this replaced was taken for stale by each of
// them, and one removed the fresh lock another had just taken: both
// created a CA, and the files on disk could end up with one's key and the
// other's certificate.
func TestStartAfterACrashedCreator(t *testing.T) {
	for i := range 20 {
		dir := t.TempDir()
		if err := os.Mkdir(filepath.Join(dir, ".creating"), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, lockFileName), nil, 0o600); err != nil {
			t.Fatal(err)
		}
		old := time.Now().Add(-time.Minute)
		for _, p := range []string{".creating", lockFileName} {
			if err := os.Chtimes(filepath.Join(dir, p), old, old); err != nil {
				t.Fatal(err)
			}
		}
		pems, errs := startTogether(dir, 8)
		if len(errs) > 0 {
			t.Fatalf("iteration %d: %d of 8 instances failed: %v", i, len(errs), errs[0])
		}
		if !checkOneCA(t, dir, pems) {
			t.Fatalf("iteration %d", i)
		}
	}
}
