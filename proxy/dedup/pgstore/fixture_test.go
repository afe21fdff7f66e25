package pgstore

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/seed-a3c387e8/onceproxy/internal/fleettest"
	"github.com/seed-a3c387e8/onceproxy/internal/logbuf"
	"github.com/seed-a3c387e8/onceproxy/internal/pgtest"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// instance is one onceproxy process as far as dedup goes: its own memory
// tier, connections, engine and listener.
type instance struct {
	name   string
	be     *Backend
	store  *Cache
	bus    *Bus
	engine *dedup.Engine
	local  *dedup.MemoryStore
	trace  *tracer
	stop   func()
}

type fleetFixture struct {
	t      *testing.T
	url    string
	schema string
	pg     *pgtest.Server // nil on the shared server
	origin *httptest.Server
	hits   atomic.Int64
	insts  []*instance
	logs   *logbuf.Buffer
	// peers: instances started from now on serve bodies too big for the
	// table on a peer listener and read them from each other's.
	peers bool
}

// newFleet starts n instances sharing a schema of their own on the shared
// server, all in front of one origin served by h.
func newFleet(t *testing.T, n int, pc Config, dc dedup.Config, h http.HandlerFunc) *fleetFixture {
	t.Helper()
	url, schema := pgtest.Schema(t)
	return startFleet(t, &fleetFixture{t: t, url: url, schema: schema}, n, pc, dc, h)
}

// newFleetOn is newFleet on a private server the test may stop.
func newFleetOn(t *testing.T, pg *pgtest.Server, n int, pc Config, dc dedup.Config, h http.HandlerFunc) *fleetFixture {
	t.Helper()
	return startFleet(t, &fleetFixture{t: t, url: pg.URL, schema: "onceproxy", pg: pg}, n, pc, dc, h)
}

func startFleet(t *testing.T, f *fleetFixture, n int, pc Config, dc dedup.Config, h http.HandlerFunc) *fleetFixture {
	f.logs = fleettest.Logs(t)
	f.origin = fleettest.Origin(t, &f.hits, h)
	for i := range n {
		f.insts = append(f.insts, f.start(fmt.Sprintf("i%d", i), pc, dc))
	}
	return f
}

// testConfig is the configuration of a test instance: small connection
// budgets (the shared server serves every test at once) and quick
// recovery.
func (f *fleetFixture) config(pc Config) Config {
	pc.URL, pc.Schema = f.url, f.schema
	if pc.MaxConns == 0 {
		pc.MaxConns, pc.FlightConns = 5, 2
	}
	if pc.BreakerInterval == 0 {
		pc.BreakerInterval = 500 * time.Millisecond
	}
	if pc.Timeout == 0 {
		// Two cores shared with other test runs under -race: a statement
		// may wait for the CPU longer than production's 250ms.
		pc.Timeout = 2 * time.Second
	}
	return pc
}

func (f *fleetFixture) start(name string, pc Config, dc dedup.Config) *instance {
	t := f.t
	logger := fleettest.Logger(f.logs, name)
	dc = fleettest.EngineConfig(dc)
	local := dedup.NewMemoryStore(int64(dc.Memory.MaxBytes))
	tr := &tracer{}
	be, err := open(f.config(pc), local, logger, tr)
	if err != nil {
		local.Close()
		t.Fatal(err)
	}
	st := be.Cache
	transport := &http.Transport{}
	var advertise func(string)
	if f.peers {
		advertise = st.AdvertisePeer
	}
	opts := dedup.Options{Store: st, Fleet: st, Recorder: be.Bus, Next: transport, Logger: logger}
	eng, _, stop := fleettest.Serve(t, dc, opts, advertise, be.Run, be.Close, local.Close, transport.CloseIdleConnections)
	return &instance{name: name, be: be, store: st, bus: be.Bus, engine: eng, local: local, trace: tr, stop: stop}
}

type got struct {
	status int
	xcache string
	key    string
	body   string
	err    error
}

// get sends a request through i, and returns once i's flights have
// handed what they fetched to the fleet's store (fleettest.Get).
func (i *instance) get(url string) got { return gotFrom(fleettest.Get(i.engine, url)) }

// gotFrom is fleettest's Got under the short names this package's tests
// use.
func gotFrom(g fleettest.Got) got { return got{g.Status, g.XCache, g.Key, g.Body, g.Err} }

// everyoneWaiting: n clients wait, and every instance but the leader's
// waits on the leader's flight.
func (f *fleetFixture) everyoneWaiting(n int64) bool { return f.contractFleet().EveryoneWaiting(n) }

// exec runs sql on the fleet's database, for a test to set up or inspect
// state; {s} is the fleet's schema.
func (f *fleetFixture) exec(sql string, args ...any) {
	f.t.Helper()
	pgtest.Exec(f.t, f.url, schemaSQL(f.schema, sql), args...)
}

// conn opens a connection of the test's own to the fleet's database.
func (f *fleetFixture) conn() *pgx.Conn {
	f.t.Helper()
	c, err := pgx.Connect(context.Background(), f.url)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

// waitFor is testkit.Eventually with its patience: the test's own
// goroutine only.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testkit.Eventually(t, testkit.Patience, cond, "%s", what)
}

// tracer counts the statements an instance sends, each with its SQL.
type tracer struct {
	mu      sync.Mutex
	queries []string
	batches int
}

func (tr *tracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "schema_version") || d.SQL == keepIdleSQL {
		// The probe of an instance without traffic, or the set-up of a
		// connection the pool opened meanwhile: not a request's.
		return ctx
	}
	tr.mu.Lock()
	tr.queries = append(tr.queries, oneLine(d.SQL))
	tr.mu.Unlock()
	return ctx
}

func (tr *tracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (tr *tracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	tr.mu.Lock()
	tr.batches++
	tr.mu.Unlock()
	return ctx
}

func (tr *tracer) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	tr.mu.Lock()
	tr.queries = append(tr.queries, "batch: "+oneLine(d.SQL))
	tr.mu.Unlock()
}

func (tr *tracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// take returns what was counted since the last take: the statements, and
// the round trips (a statement alone, or a whole batch).
func (tr *tracer) take() (statements []string, roundTrips int) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	statements = tr.queries
	roundTrips = tr.batches
	for _, q := range statements {
		if !strings.HasPrefix(q, "batch: ") {
			roundTrips++
		}
	}
	tr.queries, tr.batches = nil, 0
	return statements, roundTrips
}

func oneLine(sql string) string {
	return strings.Join(strings.Fields(sql), " ")
}
