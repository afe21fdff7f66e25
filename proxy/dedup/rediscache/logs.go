package rediscache

import (
	"context"
	"fmt"
	"log/slog"
	"strings"

	"github.com/redis/go-redis/v9"
)

// RouteLogs sends go-redis's own log lines (one per failed dial while Redis
// is down) to logger at debug level: the breaker already logs the outage
// once, and a proxy must not write a line per request about it. go-redis
// has one process-wide logger, hence a function, called once by main.
func RouteLogs(logger *slog.Logger) {
	redis.SetLogger(slogAdapter{logger})
}

type slogAdapter struct{ l *slog.Logger }

func (a slogAdapter) Printf(ctx context.Context, format string, v ...any) {
	a.l.Log(ctx, slog.LevelDebug, "redis: "+strings.TrimSpace(fmt.Sprintf(format, v...)))
}
