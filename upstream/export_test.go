package upstream

import (
	"context"
	"time"
)

// SetClock replaces the pool's clock of marks and cooldowns.
func SetClock(p *Pool, now func() time.Time) { p.now = now }

// RefreshNow fetches every provider's session list once, as Run's loops
// do, and returns the first error.
func RefreshNow(ctx context.Context, p *Pool) error {
	var first error
	for _, pv := range p.st.Load().apiGroups() {
		if err := p.refresh(ctx, pv); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// RuleFor names the rule the pool applies to a request for host and path.
func RuleFor(p *Pool, host, urlPath string) string { return p.st.Load().match(host, urlPath).name }

// CheckProviders re-checks the providers' availability now, as Run does
// every second.
func CheckProviders(p *Pool) { p.checkProviders() }

// RefreshOf is the refresh status of the pool's first provider with an API.
func RefreshOf(p *Pool) RefreshStatus {
	for _, ps := range p.Providers() {
		if ps.Refresh != nil {
			return *ps.Refresh
		}
	}
	return RefreshStatus{}
}
