package app

import (
	"log/slog"
	"strconv"
	"time"

	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// warnTTLOverRotation: a response cached longer than a timed session keeps
// its exit IP may be served after that IP is gone (geo- or IP-specific
// pages), which is worth knowing.
func warnTTLOverRotation(logger *slog.Logger, cfg *Config, up *upstream.Pool) {
	rot, ok := up.TimedRotationMin()
	if !ok {
		return
	}
	check := func(rule string, ttl time.Duration) {
		if ttl > rot {
			logger.Warn("a cache TTL is longer than the shortest timed session rotation: cached answers may outlive the exit IP that fetched them",
				"rule", rule, "ttl", ttl, "rotation", rot)
		}
	}
	if cfg.Dedup.Enabled {
		check("dedup (default)", cfg.Dedup.TTL)
	}
	for i, r := range cfg.Dedup.Rules {
		if r.TTL != nil {
			name := r.Name
			if name == "" {
				name = "dedup.rules[" + strconv.Itoa(i) + "]"
			}
			check(name, *r.TTL)
		}
	}
}
