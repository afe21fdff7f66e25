package dedup

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"unicode"
	"unicode/utf8"
)

// SavingsConfig is the `savings:` section: what going upstream costs, so
// the savings report can say it in money. Providers bill per request and
// per GB as transferred; a HIT or COALESCED answer saves both.
type SavingsConfig struct {
	// PricePerGB is the price of one GB (10^9 bytes) of upstream traffic.
	PricePerGB float64 `yaml:"price_per_gb"`
	// PricePer1000Requests is the price of 1,000 upstream requests.
	PricePer1000Requests float64 `yaml:"price_per_1000_requests"`
	// Currency names the unit of both prices ("USD").
	Currency string `yaml:"currency"`
}

// WithDefaults returns c with the currency defaulted to USD.
func (c SavingsConfig) WithDefaults() SavingsConfig {
	if c.Currency == "" {
		c.Currency = "USD"
	}
	return c
}

// Validate reports every problem in c.
func (c SavingsConfig) Validate() error {
	var errs []error
	for _, p := range []struct {
		key string
		v   float64
	}{{"price_per_gb", c.PricePerGB}, {"price_per_1000_requests", c.PricePer1000Requests}} {
		if p.v < 0 || math.IsNaN(p.v) || math.IsInf(p.v, 0) {
			errs = append(errs, fmt.Errorf("%s: must be a price of 0 or more, got %v", p.key, p.v))
		}
	}
	// The currency is the label of onceproxy_money_saved_total: bytes that
	// are not UTF-8 (an environment variable may hold any) make the
	// registry drop the metric at every scrape, and say so to no one.
	printable := utf8.ValidString(c.Currency) && !strings.ContainsFunc(c.Currency, func(r rune) bool { return !unicode.IsPrint(r) })
	if c.Currency != "" && (len(c.Currency) > 8 || !printable || strings.ContainsAny(c.Currency, " \t\n\"<>")) {
		errs = append(errs, fmt.Errorf("currency: %q is not a currency code such as USD", c.Currency))
	}
	return errors.Join(errs...)
}

// Price is what one upstream costs.
type Price struct {
	PerGB, Per1000Requests float64
}

// Prices says what each upstream costs: the session that fetched a
// response (its X-Onceproxy-Upstream value, "direct" without one) may have
// a provider of its own with its own prices.
type Prices interface {
	PriceOf(upstream string) Price
}

// Price returns the configured prices for every upstream: c is a Prices.
func (c SavingsConfig) PriceOf(string) Price {
	return Price{PerGB: c.PricePerGB, Per1000Requests: c.PricePer1000Requests}
}

// saved is the money one avoided request saved: the request, and its
// bytes as the upstream would have billed them (the stored body is the
// origin's bytes, as transferred).
func (p Price) saved(bytes int) float64 {
	return p.Per1000Requests/1000 + float64(bytes)/1e9*p.PerGB
}

// nano turns money into whole billionths, for counting with atomics. A
// saving past what an int64 holds (a price of billions) is the most it
// holds: Go's conversion of a float out of range gives the least on
// amd64, and onceproxy_money_saved_total went back below zero.
func nano(v float64) int64 {
	n := math.Round(v * 1e9)
	if n >= math.MaxInt64 { // float64(math.MaxInt64) is 2^63, itself out of range
		return math.MaxInt64
	}
	return int64(n)
}

// pricing is one configuration's way to price savings.
type pricing struct {
	prices   Prices
	currency string
}

func (e *Engine) newPricing(c SavingsConfig) *pricing {
	if e.perUpstream != nil {
		return &pricing{prices: e.perUpstream, currency: c.Currency}
	}
	return &pricing{prices: c, currency: c.Currency}
}
