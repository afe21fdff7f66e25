package testkit

import (
	"context"
	"sync"
	"testing"
)

// A Gate holds an origin's handlers until the test opens it.
//
// A handler blocked on a bare channel outlives a test that fails before
// closing it, and httptest.Server.Close waits for every handler: the
// failure turns into a hang until the binary's timeout, which hides the
// failure's own message and every test after it. A Gate opens on its own
// when the test ends, and its Wait also returns when the request's context
// does (the proxy hung up).
type Gate struct {
	ch   chan struct{}
	once sync.Once
}

// NewGate returns a shut Gate that t's cleanup opens. Make it after the
// servers whose handlers wait on it, so that this cleanup runs before
// theirs (cleanups run last-registered first); a handler may refer to it
// through a variable set after the server starts.
func NewGate(t testing.TB) *Gate {
	g := &Gate{ch: make(chan struct{})}
	t.Cleanup(g.Open)
	return g
}

// Open lets every waiter through, now and later. Calls after the first do
// nothing.
func (g *Gate) Open() { g.once.Do(func() { close(g.ch) }) }

// Wait returns once the gate is open or ctx is done, and reports whether
// the gate opened.
func (g *Gate) Wait(ctx context.Context) bool {
	select {
	case <-g.ch:
		return true
	case <-ctx.Done():
		return false
	}
}
