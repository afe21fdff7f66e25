package pgstore

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/sony/gobreaker/v2"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// client is what the Cache and the Bus share: the connections, the
// breaker, the statements, and this process's identity in the fleet.
type client struct {
	cfg Config
	log *slog.Logger
	cb  *gobreaker.CircuitBreaker[any]

	// pool runs the short statements; flights has the FlightConns
	// connections of the sessions, which hold the locks of the flights
	// this instance leads, at most FlightLocks at once (slots); listen is
	// the configuration of the one LISTEN connection.
	pool        *pgxpool.Pool
	flights     *pgxpool.Pool
	sessions    []*lockSession
	nextSession atomic.Uint32
	held        heldLocks
	slots       chan struct{}
	listen      *pgx.ConnConfig

	sql      statements
	instance string        // random id of this process: marks its notes and claims
	seq      atomic.Uint64 // claim token counter
	channel  string        // the one notification channel

	// ready is set once the schema is checked (and created): until then,
	// and after a refusal, the shared layer is unavailable.
	ready   atomic.Bool
	refused atomic.Bool

	// rejected counts input from the database that was ignored
	// (Backend.Rejected).
	rejected atomic.Int64
	// failed counts statements that failed (Backend.Errors).
	failed atomic.Int64
	// lastUse is when a statement last went to the database (UnixNano):
	// an instance without traffic probes instead.
	lastUse atomic.Int64

	mu     sync.Mutex
	onBack []func() // run each time the database comes back after an outage

	// life is canceled by Close: waits and reconnect work stop with it.
	life   context.Context
	cancel context.CancelFunc
	bg     sync.WaitGroup // onBack functions and background work running
	leases sync.WaitGroup // flights holding a lock
}

// The server-side settings of every connection.
const (
	// idleInTxTimeout ends a session stuck in a transaction: none of ours
	// stays in one longer than a round trip.
	idleInTxTimeout = 10 * time.Second
	// A leader whose machine vanishes without closing its connections
	// keeps its flights' locks until the server gives up on it: about
	// idle + count × interval (25 s) with these keepalives, instead of the
	// operating system's two hours.
	keepaliveIdle     = 10 * time.Second
	keepaliveInterval = 5 * time.Second
	keepaliveCount    = 3
)

// keepIdleSQL is keepIdle's statement: once per new connection.
const keepIdleSQL = "SET idle_session_timeout = 0"

// keepIdle turns idle_session_timeout off on a connection of ours. A lock
// session idles for as long as its leader fetches and the LISTEN
// connection for as long as nothing happens: a server, role or database
// that set it would end them, and with them their flights' locks (a
// second leader) and the notifications sent meanwhile. Not a start-up
// parameter: servers before PostgreSQL 14 have no such setting, and
// refuse a connection that names one.
func keepIdle(ctx context.Context, conn *pgx.Conn) error {
	_, err := conn.Exec(ctx, keepIdleSQL)
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "42704" { // undefined_object: before PostgreSQL 14
		return nil
	}
	if err != nil {
		return fmt.Errorf("set idle_session_timeout: %w", err)
	}
	return nil
}

func newClient(cfg Config, logger *slog.Logger, tracer pgx.QueryTracer) (*client, error) {
	base, err := pgxpool.ParseConfig(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("url: %w", err)
	}
	cc := base.ConnConfig
	cc.ConnectTimeout = cfg.DialTimeout
	dialer := &net.Dialer{
		Timeout: cfg.DialTimeout,
		// The client side notices a database gone silent too.
		KeepAliveConfig: net.KeepAliveConfig{Enable: true, Idle: keepaliveIdle, Interval: keepaliveInterval, Count: keepaliveCount},
	}
	cc.DialFunc = dialer.DialContext
	if cc.RuntimeParams == nil {
		cc.RuntimeParams = map[string]string{}
	}
	params := map[string]string{
		"statement_timeout":                   strconv.FormatInt(cfg.Timeout.Milliseconds(), 10),
		"idle_in_transaction_session_timeout": strconv.FormatInt(idleInTxTimeout.Milliseconds(), 10),
		"tcp_keepalives_idle":                 strconv.Itoa(int(keepaliveIdle.Seconds())),
		"tcp_keepalives_interval":             strconv.Itoa(int(keepaliveInterval.Seconds())),
		"tcp_keepalives_count":                strconv.Itoa(keepaliveCount),
	}
	for k, v := range params {
		cc.RuntimeParams[k] = v
	}
	if cc.RuntimeParams["application_name"] == "" {
		cc.RuntimeParams["application_name"] = "onceproxy"
	}
	cc.Tracer = tracer
	base.AfterConnect = keepIdle

	poolCfg := base.Copy()
	poolCfg.MaxConns = int32(cfg.poolConns())
	pool, err := pgxpool.NewWithConfig(context.Background(), poolCfg)
	if err != nil {
		return nil, fmt.Errorf("pool: %w", err)
	}
	flightCfg := base.Copy()
	flightCfg.MaxConns = int32(cfg.FlightConns)
	flights, err := pgxpool.NewWithConfig(context.Background(), flightCfg)
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("pool: %w", err)
	}
	listen := cc.Copy()
	listen.Tracer = nil

	c := &client{
		cfg:      cfg,
		log:      logger,
		pool:     pool,
		flights:  flights,
		slots:    make(chan struct{}, cfg.FlightLocks),
		listen:   listen,
		sql:      newStatements(cfg.Schema),
		instance: randomHex(6),
		channel:  cfg.Schema + "_events",
	}
	for range cfg.FlightConns {
		c.sessions = append(c.sessions, newLockSession())
	}
	c.life, c.cancel = context.WithCancel(context.Background())
	c.cb = gobreaker.NewCircuitBreaker[any](gobreaker.Settings{
		Name:        "postgres",
		MaxRequests: 1, // one probe when the interval is over
		Timeout:     cfg.BreakerInterval,
		ReadyToTrip: func(n gobreaker.Counts) bool { return n.ConsecutiveFailures >= uint32(cfg.BreakerFailures) },
		IsSuccessful: func(err error) bool {
			return err == nil || errors.Is(err, pgx.ErrNoRows)
		},
		// A caller that gave up says nothing about the database.
		IsExcluded: func(err error) bool {
			return errors.Is(err, errCallerGone) || notFailure(err)
		},
		OnStateChange: func(_ string, from, to gobreaker.State) {
			switch to {
			case gobreaker.StateOpen:
				c.log.Warn("postgres unavailable: deduplicating per instance (memory store, local flights) until it is back",
					"retry_in", cfg.BreakerInterval)
			case gobreaker.StateClosed:
				c.log.Info("postgres is back: sharing cache and flights with the fleet again")
				if from != gobreaker.StateClosed {
					c.reconnected()
				}
			}
		},
	})
	return c, nil
}

// start checks (and creates) the schema once at start. A database that is
// down is not an error: the probe takes it from there. A schema this build
// must not use is.
func (c *client) start() error {
	ctx, cancel := context.WithTimeout(c.life, c.cfg.DialTimeout+setupTimeout)
	defer cancel()
	err := c.setup(ctx)
	switch {
	case err == nil:
		c.ready.Store(true)
		c.log.Info("postgres connected: cache and flights shared with the fleet", "postgres", describe(c.listen), "schema", c.cfg.Schema)
		return nil
	case errors.Is(err, errSchema):
		return err
	}
	c.log.Warn("postgres not reachable at start; running alone until it is", "postgres", describe(c.listen), "err", err)
	return nil
}

// describe names the database for logs, without credentials.
func describe(cc *pgx.ConnConfig) string {
	return net.JoinHostPort(cc.Host, strconv.Itoa(int(cc.Port))) + "/" + cc.Database
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// available reports whether the shared layer is in use: the schema is
// checked and the breaker is not open.
func (c *client) available() bool {
	return c.ready.Load() && !c.refused.Load() && c.cb.State() != gobreaker.StateOpen
}

// errCallerGone marks a statement cut short because its caller gave up:
// not the database's fault, not counted by the breaker.
var errCallerGone = errors.New("pgstore: caller gave up")

// notFailure reports an error that says nothing of the database's
// health, which neither the breaker nor the error count hears of: busy or
// closing lock sessions, a full lock table, a flight's lock found gone
// (the failure that dropped its connection was counted then).
func notFailure(err error) bool {
	return errors.Is(err, errSessionsBusy) || errors.Is(err, errClosing) || errors.Is(err, errLockGone) || isLockTableFull(err)
}

// exec runs one database operation through the breaker, bounded by the
// dial and statement timeouts. It returns nil, pgx.ErrNoRows, the caller's
// context error, or an error wrapping dedup.ErrUnavailable.
func (c *client) exec(ctx context.Context, op func(context.Context) error) error {
	if !c.ready.Load() || c.refused.Load() {
		return dedup.ErrUnavailable
	}
	_, err := c.cb.Execute(func() (any, error) {
		octx, cancel := context.WithTimeout(ctx, c.cfg.DialTimeout+c.cfg.Timeout)
		defer cancel()
		c.lastUse.Store(time.Now().UnixNano())
		err := op(octx)
		switch {
		case err == nil, errors.Is(err, pgx.ErrNoRows):
		case ctx.Err() != nil:
			return nil, fmt.Errorf("%w: %w", errCallerGone, ctx.Err())
		case notFailure(err):
		default:
			c.failed.Add(1)
		}
		return nil, err
	})
	switch {
	case err == nil, errors.Is(err, pgx.ErrNoRows):
		return err
	case errors.Is(err, errCallerGone):
		return ctx.Err()
	case errors.Is(err, gobreaker.ErrOpenState), errors.Is(err, gobreaker.ErrTooManyRequests):
		return dedup.ErrUnavailable
	default:
		return fmt.Errorf("%w: %w", dedup.ErrUnavailable, err)
	}
}

// probeEvery is how often the probe looks at the database.
func (c *client) probeEvery() time.Duration { return min(c.cfg.BreakerInterval/4, time.Second) }

// probe keeps the breaker, and so /health's store_available, true to the
// database also on an instance without traffic: while the schema is not
// checked yet it tries that; while the breaker is not closed it sends the
// breaker's probe (the schema check) as soon as the breaker lets one
// through, which brings the shared layer back by itself; and while no
// request has used the database for a probe interval, it checks it, so an
// outage opens the breaker of an idle instance too.
func (c *client) probe(ctx context.Context) {
	every := c.probeEvery()
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		switch {
		case c.refused.Load():
		case !c.ready.Load():
			c.becomeReady(ctx)
		case c.cb.State() != gobreaker.StateClosed, time.Since(time.Unix(0, c.lastUse.Load())) >= every:
			err := c.exec(ctx, c.checkSchema)
			if errors.Is(err, errSchema) {
				c.refuse(err)
			}
		}
	}
}

// becomeReady checks the schema of a database that was down at start.
func (c *client) becomeReady(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.DialTimeout+setupTimeout)
	defer cancel()
	err := c.setup(ctx)
	switch {
	case err == nil:
		c.ready.Store(true)
		c.log.Info("postgres reachable: sharing cache and flights with the fleet", "postgres", describe(c.listen))
		c.reconnected()
	case errors.Is(err, errSchema):
		c.refuse(err)
	default:
		c.log.Debug("postgres still not reachable", "err", err)
	}
}

// refuse turns the shared layer off for good: the schema changed under a
// running instance (another version started on it).
func (c *client) refuse(err error) {
	if !c.refused.Swap(true) {
		c.log.Error("postgres schema refused; this instance runs alone until restarted", "err", err)
	}
}

// onReconnect registers f to run each time the database comes back after
// an outage (and when it appears after a start without it).
func (c *client) onReconnect(f func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.onBack = append(c.onBack, f)
}

// reconnected runs the onReconnect functions. It may be called from the
// breaker's state change, under the breaker's lock, where a statement
// would deadlock: hence goroutines, which Close waits for.
func (c *client) reconnected() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.life.Err() != nil {
		return
	}
	for _, f := range c.onBack {
		c.bg.Add(1)
		go func() {
			defer c.bg.Done()
			defer c.recoverInput("reconnect")
			f()
		}()
	}
}

// background runs f in a goroutine that Close waits for, with a context
// that Close cancels; false (f not run) once Close has begun.
func (c *client) background(f func(ctx context.Context)) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.life.Err() != nil {
		return false
	}
	c.bg.Add(1)
	go func() {
		defer c.bg.Done()
		f(c.life)
	}()
	return true
}

// recoverInput keeps a panic while handling what came from the database
// from taking the process down: it is logged and counted as rejected
// input. Deferred by every goroutine that handles fleet input.
func (c *client) recoverInput(where string) {
	if r := recover(); r != nil {
		c.rejected.Add(1)
		c.log.Error("panic while handling input from postgres; ignored", "where", where,
			"panic", r, "stack", string(debug.Stack()))
	}
}

// newToken names one claim held by this process: only its holder may
// release it.
func (c *client) newToken() string {
	return c.instance + "-" + strconv.FormatUint(c.seq.Add(1), 36)
}

// lockID is the advisory lock of name in this schema: 64 bits of a hash,
// so fleets in other schemas of the same database never share a lock.
func (c *client) lockID(name string) int64 {
	h := sha256.Sum256([]byte(c.cfg.Schema + "\x00" + name))
	return int64(binary.BigEndian.Uint64(h[:8]))
}

// storable reports whether s can be a text value: PostgreSQL text is valid
// UTF-8 without NUL. Keys and names that are not were never stored.
func storable(s string) bool {
	return utf8.ValidString(s) && !strings.ContainsRune(s, 0)
}

// isUndefined reports an error of a missing schema, table or function.
func isUndefined(err error) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return false
	}
	switch pe.Code {
	case "3F000", "42P01", "42883": // invalid_schema_name, undefined_table, undefined_function
		return true
	}
	return false
}

// hexKey names s by its hash, for names that cannot be stored as text.
func hexKey(s string) string {
	h := sha256.Sum256([]byte(s))
	return hex.EncodeToString(h[:])
}
