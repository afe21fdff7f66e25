package rediscache

import (
	"io"
	"log/slog"
	"os"
	"testing"
)

func TestMain(m *testing.M) {
	RouteLogs(slog.New(slog.NewTextHandler(io.Discard, nil)))
	os.Exit(m.Run())
}
