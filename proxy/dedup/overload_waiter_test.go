package dedup

import (
	"context"
	"net/http"
	"testing"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
)

// TestWaiterIsNotRefusedForTheLeadersLimit: a flight whose leader's client
// is over its own max_flights_per_client ends with a 503 that speaks of
// "this client": a request of another client that joined the flight in
// the meantime is not over any limit, and gets its answer from a flight
// of its own instead of that 503.
func TestWaiterIsNotRefusedForTheLeadersLimit(t *testing.T) {
	f := newFixture(t, Config{TTL: 0, MaxFlights: 10, MaxFlightsPerClient: 1}, http.HandlerFunc(okHandler))
	as := func(client string) context.Context {
		return clientinfo.With(context.Background(), clientinfo.Info{Client: client})
	}
	// Client A is at its limit; its request joins the flight for /x and
	// then waits here, on the engine's lock, before the flight starts.
	f.eng.mu.Lock()
	f.eng.perClient["ip:10.0.0.1"] = 1
	leader := make(chan result, 1)
	go func() { leader <- f.do(as("ip:10.0.0.1"), http.MethodGet, "/x", nil, "") }()
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.st.waiters.Load() == 1 }, "the leader on its flight")
	waiter := make(chan result, 1)
	go func() { waiter <- f.do(as("ip:10.0.0.2"), http.MethodGet, "/x", nil, "") }()
	testkit.Eventually(t, testkit.Patience, func() bool { return f.eng.st.waiters.Load() == 2 }, "the second client waiting on it")
	f.eng.mu.Unlock()

	if r := <-leader; r.err == nil {
		t.Fatalf("the client over its limit: %+v, want its 503", r)
	}
	if r := <-waiter; r.err != nil || r.status != http.StatusOK {
		t.Fatalf("the other client got %+v: the leader's per-client limit refused it", r)
	}
	f.eng.mu.Lock()
	delete(f.eng.perClient, "ip:10.0.0.1")
	f.eng.mu.Unlock()
}
