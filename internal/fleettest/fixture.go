package fleettest

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/logbuf"
)

// Origin is the origin a fleet is in front of: h on a loopback server,
// closed at the test's end, each request counted in hits.
func Origin(t testing.TB, hits *atomic.Int64, h http.HandlerFunc) *httptest.Server {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		h(w, r)
	}))
	t.Cleanup(origin.Close)
	return origin
}

// Logs is where a fleet's instances log (Logger): the test shows it if
// it fails, as the story of what each instance did.
func Logs(t testing.TB) *logbuf.Buffer {
	logs := &logbuf.Buffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("logs:\n%s", logs.String())
		}
	})
	return logs
}

// Logger is the logger of the instance called name, at debug level, into
// logs.
func Logger(logs io.Writer, name string) *slog.Logger {
	return slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})).With("instance", name)
}
