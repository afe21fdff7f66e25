package proxy

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
)

// brokenConn fails every write, as a connection whose client left does.
type brokenConn struct{}

var errBroken = errors.New("broken pipe")

func (brokenConn) Write([]byte) (int, error) { return 0, errBroken }

// TestStreamedWriteReportsTheFlush: a body piece that fits the lean
// writer's buffer fails on its flush when the client is gone, and the
// write says so, so that the copy from the origin stops at once instead
// of reading on (a piece more, or the whole rest of a body that arrives
// slowly) for a client that left.
func TestStreamedWriteReportsTheFlush(t *testing.T) {
	req := httptest.NewRequest(http.MethodGet, "http://a.test/", nil)
	w := newH1Writer(brokenConn{}, req, &h1Conns{})
	defer w.release()
	fw := streamTo(w)
	if _, err := fw.Write([]byte("a piece smaller than the buffer")); !errors.Is(err, errBroken) {
		t.Fatalf("Write = %v, want the flush's %v", err, errBroken)
	}
}
