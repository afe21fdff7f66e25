package rediscache

import (
	"net/http"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/bindingstest"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestBindingsAgreeAcrossInstances: the upstream.Bindings contract
// (bindingstest.Agree) on two instances of one store.
func TestBindingsAgreeAcrossInstances(t *testing.T) {
	f := newFleet(t, 2, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) {})
	bindingstest.Agree(t, f.insts[0].bus, f.insts[1].bus)
}
