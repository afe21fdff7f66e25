package app

import (
	"errors"
	"os"
	"strings"
	"testing"
)

// TestReloadRefusesBadValues: a reload reads the configuration as
// start-up does, so each value start-up refuses is refused by a reload
// too, every problem named by key (the admin API answers 422 with them),
// and the running configuration stays. Each of these was accepted once:
// a fraction where a whole number goes, a port no dial takes, two
// upstream rules of one name, memory_limit 0, a negative fleet value with
// the peer listener off.
func TestReloadRefusesBadValues(t *testing.T) {
	path := writeConfig(t, "log: {level: info}\n")
	a := buildFromFile(t, path, nil)
	running := a.cfg
	for _, tc := range []struct {
		text string
		want []string
	}{
		// Values that decode are checked together with those that do
		// not (below).
		{"upstream:\n  sessions: [{id: s1, url: 'http://127.0.0.1:99999'}]\n" +
			"  rules: [{name: api, host: a.example}, {name: api, host: b.example}]\nfleet: {peer_timeout: -1s}\n",
			[]string{"upstream.sessions[0].url:", "port must be 1-65535",
				`upstream.rules[1].name: "api" is already used by rules[0]`, "fleet.peer_timeout: must be positive"}},
		{"upstream:\n  retry: {max_attempts: 2.9}\n", []string{"line 2: upstream.retry.max_attempts: 2.9 is not a whole number"}},
		{"process: {memory_limit: 0}\n", []string{"line 1: process.memory_limit:", "write off"}},
		{"upstream: {sessions: [{id: s1, url: 'http://127.0.0.1:1', weight: 0}]}\n", []string{"upstream.sessions[0].weight: 0 has no meaning here"}},
		{"process: {memory_limit: 0}\nupstream: {retry: {max_attempts: 2.9}, rules: [{name: a}, {name: a}]}\nproxy: {lisen: x}\n",
			[]string{"line 1: process.memory_limit:", "line 2: upstream.retry.max_attempts: 2.9", `line 3: unknown key "proxy.lisen"`,
				`upstream.rules[1].name: "a" is already used by rules[0]`}},
	} {
		if err := os.WriteFile(path, []byte(tc.text), 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := a.Reload()
		var p interface{ Problems() []string }
		if !errors.As(err, &p) {
			t.Fatalf("reload of %q: %v, want it refused with the problems listed", tc.text, err)
		}
		for _, w := range tc.want {
			if !strings.Contains(strings.Join(p.Problems(), "\n"), w) {
				t.Errorf("reload of %q: problems %q lack %q", tc.text, p.Problems(), w)
			}
		}
		if a.cfg != running || a.cfg.Upstream.Retry.MaxAttempts != 3 || len(a.cfg.Upstream.Sessions) != 0 {
			t.Errorf("reload of %q changed the running configuration", tc.text)
		}
	}
}
