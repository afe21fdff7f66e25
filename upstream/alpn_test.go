package upstream

import (
	"testing"
	"time"
)

// TestALPNMemory: what an origin chose is remembered only when the offer
// included HTTP/2, under one name whatever the host's case or trailing
// dot, and HTTP/2 sticks once chosen (a load balancer's mixed servers do
// not make the MITM flip at every connection).
func TestALPNMemory(t *testing.T) {
	both := []string{"h2", "http/1.1"}
	m := newALPNMemory()
	check := func(addr, want string, known bool) {
		t.Helper()
		if p, ok := m.protocol(addr); p != want || ok != known {
			t.Errorf("protocol(%q) = %q, %v; want %q, %v", addr, p, ok, want, known)
		}
	}
	check("a.test:443", "", false)

	m.record("a.test:443", []string{"http/1.1"}, "http/1.1")
	check("a.test:443", "", false) // an offer without h2 says nothing

	m.record("A.Test.:443", both, "http/1.1")
	check("a.test:443", "http/1.1", true)
	check("a.test:8443", "", false)

	m.record("a.test:443", both, "")
	check("a.test:443", "", true) // no protocol at all: known as such

	m.record("a.test:443", []string{"H2"}, "h2")
	check("a.test:443", "h2", true)
	m.record("a.test:443", both, "http/1.1")
	check("a.test:443", "h2", true) // HTTP/2 sticks

	m.record("[::1]:443", both, "http/1.1")
	check("[::1]:443", "http/1.1", true)

	// An hour on, what was chosen is forgotten, HTTP/2 included, and an
	// origin that chose HTTP/1.1 since is known as such.
	start := time.Now()
	m.now = func() time.Time { return start.Add(memoryTTL) }
	check("a.test:443", "", false)
	check("[::1]:443", "", false)
	m.record("a.test:443", both, "http/1.1")
	check("a.test:443", "http/1.1", true)

	var none *alpnMemory
	none.record("a.test:443", both, "h2")
	if _, ok := none.protocol("a.test:443"); ok {
		t.Error("a nil memory knows an origin")
	}
}
