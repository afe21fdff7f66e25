package rediscache

import (
	"bytes"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestConfigValidate(t *testing.T) {
	err := Config{URL: "redis://a:1", Addrs: []string{"b"}, MasterName: "m", DialTimeout: -1, Lease: time.Millisecond, PresenceTTL: time.Second, Timeout: time.Second, BreakerFailures: -1, MaxValueBytes: 1}.Validate()
	for _, want := range []string{"url: set either", "addrs[0]:", "dial_timeout:", "lease:", "presence_ttl:", "breaker_failures:", "max_value_bytes:"} {
		if err == nil || !bytes.Contains([]byte(err.Error()), []byte(want)) {
			t.Errorf("missing %q in %v", want, err)
		}
	}
	if err := (Config{URL: "redis://127.0.0.1:6379/0"}).WithDefaults().Validate(); err != nil {
		t.Fatal(err)
	}
	// presence_ttl follows a longer timeout unless set.
	if c := (Config{URL: "redis://127.0.0.1:6379/0", Timeout: 2 * time.Second, Lease: 10 * time.Second}).WithDefaults(); c.PresenceTTL != 6*time.Second || c.Validate() != nil {
		t.Fatalf("presence_ttl %s with timeout 2s: %v", c.PresenceTTL, c.Validate())
	}
	if c := (Config{}).WithDefaults(); c.PresenceTTL != 1500*time.Millisecond {
		t.Fatalf("default presence_ttl %s", c.PresenceTTL)
	}
	if err := (Config{URL: "http://nope"}).WithDefaults().Validate(); err == nil {
		t.Fatal("bad URL accepted")
	}
	for _, prefix := range []string{"{onceproxy}:", "op{", "op}:"} {
		err := (Config{URL: "redis://127.0.0.1:6379/0", KeyPrefix: prefix}).WithDefaults().Validate()
		if err == nil || !strings.Contains(err.Error(), "key_prefix: must not contain { or }") {
			t.Errorf("key_prefix %q: %v", prefix, err)
		}
	}
}

// TestFlightKeys: the keys cut from one string are the ones each name
// gives, in the scripts' order.
func TestFlightKeys(t *testing.T) {
	c := &client{prefix: "onceproxy:v1:"}
	for _, tag := range []string{"abc", "", "0123456789abcdef0123456789abcdef"} {
		got := c.flightKeys(tag)
		want := []string{c.lockKey(tag), c.valueKey(tag), c.outcomeKey(tag), c.waitersKey(tag)}
		if !slices.Equal(got, want) {
			t.Errorf("flightKeys(%q) = %q, want %q", tag, got, want)
		}
	}
}

// TestConfigValidateBreakerFailures: the breaker counts consecutive
// failures in 32 bits, and breaker_failures 2^32 became 0 there, a breaker
// that opened on the first failed command. It is refused.
func TestConfigValidateBreakerFailures(t *testing.T) {
	c := Config{URL: "redis://127.0.0.1:6379/0", BreakerFailures: 1 << 32}.WithDefaults()
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "breaker_failures: must be at most 4294967295") {
		t.Errorf("breaker_failures 2^32: %v", err)
	}
}

// TestConfigValidateHugeTimeout: 3 × timeout wrapped round for a timeout
// past a third of the longest duration, so a lease and a presence_ttl
// shorter than the timeout passed (and presence_ttl's default fell back
// to 1.5s). No lease can be 3 × such a timeout: it is refused.
func TestConfigValidateHugeTimeout(t *testing.T) {
	base := Config{URL: "redis://127.0.0.1:6379/0", Timeout: 1_000_000 * time.Hour, Lease: 2_000_000 * time.Hour}
	if c := base.WithDefaults(); c.PresenceTTL < c.Timeout {
		t.Errorf("presence_ttl defaults to %s, shorter than timeout %s", c.PresenceTTL, c.Timeout)
	}
	withPresence := base
	withPresence.PresenceTTL = 2_000_000 * time.Hour
	err := withPresence.WithDefaults().Validate()
	for _, want := range []string{"lease: must be at least 3 × timeout", "presence_ttl: must be at least 3 × timeout"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("timeout 1000000h: %v, want %q", err, want)
		}
	}
}
