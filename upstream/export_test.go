package upstream

import (
	"context"
	"time"
)

// SetClock replaces the pool's clock of marks and cooldowns.
func SetClock(p *Pool, now func() time.Time) { p.now = now }

// RefreshNow fetches the provider's session list once, as Run's loop does.
func RefreshNow(ctx context.Context, p *Pool) error { return p.refresh(ctx) }

// RuleFor names the rule the pool applies to a request for host and path.
func RuleFor(p *Pool, host, urlPath string) string { return p.match(host, urlPath).name }
