package dedup

import "fmt"

// Reconfigure applies a new configuration while requests flow (a reload):
// the rules and what they decide (enabled, ttl, key_headers,
// ignore_params, cacheable_statuses, rules) and the savings prices.
// Requests already matched keep the rule they matched; flights running
// keep theirs. The sizes, limits, timeouts and directories the engine was
// built with stay: changing them needs a restart (the caller reports
// them). It fails, changing nothing, for an invalid cfg.
func (e *Engine) Reconfigure(cfg Config, savings SavingsConfig) error {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("dedup: %w", err)
	}
	savings = savings.WithDefaults()
	if err := savings.Validate(); err != nil {
		return fmt.Errorf("dedup: savings: %w", err)
	}
	e.rules.Store(compileRules(cfg))
	e.pricing.Store(e.newPricing(savings))
	return nil
}
