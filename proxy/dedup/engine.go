package dedup

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/httpstatus"
	"github.com/seed-a3c387e8/onceproxy/internal/workers"
)

// Options are the parts an Engine is wired from.
type Options struct {
	// Store holds cached responses. Required.
	Store Store
	// Next sends requests upstream. Required.
	Next http.RoundTripper
	// Logger receives warnings. Required.
	Logger *slog.Logger
	// Fleet shares flights with other processes; nil: this process only.
	Fleet Fleet
	// Recorder also receives every outcome (fleet statistics); optional.
	Recorder Recorder
	// Savings prices what a HIT or COALESCED answer saved; zero prices
	// count no money.
	Savings SavingsConfig
	// Prices, when set, prices each upstream on its own (providers with
	// their own prices); Savings otherwise.
	Prices Prices
	// Peers reads bodies from other instances' peer listeners (a
	// PeerClient): a flight whose leader elsewhere streams a body too big
	// for the shared store reads it from there. nil: such bodies are
	// fetched from the origin by every instance.
	Peers http.RoundTripper
}

// Engine deduplicates requests: it answers from the cache, makes identical
// concurrent requests wait on one upstream fetch (a flight), and caches what
// may be cached. It is an http.RoundTripper in front of the upstream; every
// response it returns carries X-Cache and X-Cache-Key.
//
// A flight's body streams: the leader's client and every waiter read it as
// it arrives, through the flight's spool (memory, then a file), each at its
// own pace. Bodies up to max_body_bytes are cached whole in the Store;
// bigger ones, up to max_object_bytes, in the engine's own disk tier.
type Engine struct {
	cfg   Config
	rules atomic.Pointer[rules] // replaced whole by Reconfigure
	store Store
	// wholeLimit is the largest body kept whole in the Store:
	// max_body_bytes, within the Store's own cap (EntryLimiter). Both are
	// fixed when the engine is built.
	wholeLimit int64
	// peek reads the cache before a flight: the whole store, or with a
	// Fleet and a TieredStore only this process's tier (Join reads the
	// shared one).
	peek  func(ctx context.Context, key string) (*Entry, error)
	next  http.RoundTripper
	peers http.RoundTripper // nil: no reading from peers
	log   *slog.Logger
	fleet Fleet
	rec   Recorder
	// pricing prices the savings report; replaced whole by Reconfigure.
	pricing atomic.Pointer[pricing]
	flights flights
	spools  *spools
	disk    *diskTier // nil: disk.max_bytes is 0
	st      counters

	// invalid remembers recent invalidations, this process's and those
	// made elsewhere in the fleet, which stopInvalidations stops hearing
	// of (InvalidationSource; nil: none).
	invalid           invalidationLog
	stopInvalidations func()

	// base is canceled by Close: flights run detached from their clients
	// but not from the engine's lifetime.
	base   context.Context
	cancel context.CancelCauseFunc
	mu     sync.Mutex // protects closed, the Add side of wg, and perClient
	closed bool
	wg     sync.WaitGroup // running flights, from their start to the end of their body
	// perClient counts the flights each client leads (entries at zero are
	// removed, so the map holds only clients with a flight running).
	perClient map[string]int
	// workers run the flights.
	workers workers.Pool
	// perUpstream prices each upstream on its own (Options.Prices); nil:
	// the savings section prices them all.
	perUpstream Prices
}

// New returns an Engine; cfg gets its defaults applied. It creates this
// process's directories under spool_dir and disk.dir; Close removes them.
func New(cfg Config, o Options) (*Engine, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("dedup: %w", err)
	}
	if o.Store == nil || o.Next == nil || o.Logger == nil {
		return nil, errors.New("dedup: Store, Next and Logger are required")
	}
	savings := o.Savings.WithDefaults()
	if err := savings.Validate(); err != nil {
		return nil, fmt.Errorf("dedup: savings: %w", err)
	}
	e := &Engine{cfg: cfg, store: o.Store, next: o.Next, peers: o.Peers, log: o.Logger, fleet: o.Fleet, rec: o.Recorder,
		perClient: map[string]int{}, perUpstream: o.Prices}
	e.wholeLimit = int64(cfg.MaxBodyBytes)
	if l, ok := o.Store.(EntryLimiter); ok {
		e.wholeLimit = min(e.wholeLimit, l.MaxEntryBytes())
	}
	e.rules.Store(compileRules(cfg))
	e.workers.MaxIdle = maxIdleWorkers
	e.pricing.Store(e.newPricing(savings))
	e.peek = o.Store.Get
	if t, ok := o.Store.(TieredStore); ok && o.Fleet != nil {
		e.peek = t.GetLocal
	}
	e.flights.m = map[string]*flight{}
	spoolDir, err := openRunDir(cfg.SpoolDir)
	if err != nil {
		return nil, fmt.Errorf("dedup: spool_dir: %w", err)
	}
	e.spools = &spools{dir: spoolDir, budget: int64(cfg.SpoolMemoryBytes), diskBudget: int64(cfg.SpoolDiskBytes)}
	if cfg.Disk.MaxBytes > 0 {
		diskDir, err := openRunDir(cfg.Disk.Dir)
		if err != nil {
			spoolDir.remove()
			return nil, fmt.Errorf("dedup: disk.dir: %w", err)
		}
		e.disk = newDiskTier(diskDir, int64(cfg.Disk.MaxBytes))
	}
	if src, ok := o.Store.(InvalidationSource); ok {
		e.stopInvalidations = src.OnInvalidated(e.invalidatedElsewhere)
	}
	// Canceled with errShuttingDown: the cause every flight still running
	// then fails with.
	e.base, e.cancel = context.WithCancelCause(context.Background())
	return e, nil
}

// Close stops flights still running (their waiters and readers get an
// error), waits for them to end, and removes the spool and disk-tier
// files. A client still sending a body it had started keeps its open file
// until it is done.
func (e *Engine) Close() {
	e.mu.Lock()
	already := e.closed
	e.closed = true
	e.mu.Unlock()
	e.cancel(errShuttingDown)
	e.wg.Wait()
	if already {
		return
	}
	e.workers.Close()
	if e.stopInvalidations != nil {
		e.stopInvalidations()
	}
	if e.disk != nil {
		e.disk.close()
	}
	e.spools.dir.remove()
}

// principalOf is who a request's responses are scoped to: the proxy
// account from clientinfo (session hints aside: two sticky sessions of one
// account are one set of credentials) and the exit country and city it
// asked for (geo content differs). Unless a rule shares credentials
// (countries), requests of different accounts (countries) never share a
// response.
func principalOf(ctx context.Context) Requester {
	info := clientinfo.From(ctx)
	return Requester{Account: info.Account, Country: info.Country, City: info.City}
}

// Error is a failed request, labelled with the X-Cache outcome it would
// have had, so the error response the caller builds carries it too.
type Error struct {
	Cache string // X-Cache value
	Key   string // X-Cache-Key; "" when the request was not keyed
	Err   error
}

func (e *Error) Error() string { return e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }

// CacheHeaders returns the X-Cache and X-Cache-Key values for the response
// that reports this error.
func (e *Error) CacheHeaders() (xcache, key string) { return e.Cache, e.Key }

// requestError is the client's fault (its request body could not be read).
type requestError struct{ err error }

func (e requestError) Error() string   { return "read request body: " + e.err.Error() }
func (e requestError) Unwrap() error   { return e.err }
func (e requestError) HTTPStatus() int { return http.StatusBadRequest }

// overloadError refuses a new flight when max_flights are running, or
// when the client already leads max_flights_per_client.
type overloadError struct {
	max       int
	perClient bool
}

func (e overloadError) Error() string {
	if e.perClient {
		return fmt.Sprintf("this client has too many upstream fetches in flight (dedup.max_flights_per_client = %d); retry shortly", e.max)
	}
	return fmt.Sprintf("too many upstream fetches in flight (dedup.max_flights = %d); retry shortly", e.max)
}
func (overloadError) HTTPStatus() int { return http.StatusServiceUnavailable }

// RetryAfter is a second: flights end in about that, and a client that
// retries at once only meets the limit again.
func (overloadError) RetryAfter() time.Duration { return time.Second }

// refusedForItsClient reports whether res is a leader's refusal under
// max_flights_per_client, which says nothing about its waiters' clients.
func refusedForItsClient(res *flightResult) bool {
	var o overloadError
	return errors.As(res.err, &o) && o.perClient
}

// timeoutError is the flight deadline: classified as a timeout (504).
type timeoutError struct{ d time.Duration }

func (e timeoutError) Error() string {
	return "upstream fetch exceeded dedup.flight_timeout (" + e.d.String() + ")"
}
func (timeoutError) Timeout() bool   { return true }
func (timeoutError) Temporary() bool { return true }

// RoundTrip implements http.RoundTripper.
func (e *Engine) RoundTrip(req *http.Request) (*http.Response, error) {
	rule := e.rules.Load().match(req)
	if !rule.dedups(req.Method) {
		return e.bypass(req, e.bodilessKey(rule, req))
	}
	body, tooBig, err := e.readBody(req)
	if err != nil {
		return nil, &Error{Cache: CacheBypass, Err: requestError{err}}
	}
	if tooBig {
		return e.bypass(req, e.bodilessKey(rule, req))
	}
	key, err := rule.keyer.Key(req.Method, req.URL, req.Header, principalOf(req.Context()), body)
	if err != nil {
		return e.bypass(req, "")
	}
	if req.Method == http.MethodGet && req.Header.Get("Range") != "" {
		if resp, handled, err := e.fromObject(req, rule, body); handled {
			return resp, err
		}
	}
	resp, flightKey, ok := e.fromCache(req, rule, key, body)
	if ok {
		return resp, nil
	}
	if req.Method == http.MethodHead {
		if resp, handled, err := e.headFromFlight(req, rule, body); handled {
			return resp, err
		}
	}
	return e.coalesce(req, rule, flightKey, body, flightKey != key)
}

// headFromFlight answers a HEAD with the head of a GET of the same URL in
// flight. A big file's download is not cached while it runs (and one past
// the disk tier never is), so without this every HEAD a fleet of workers
// makes before its GET, or to learn a size, went upstream on its own while
// the body was already coming. handled is false when no such flight runs,
// or when its result is no response for this client (an error, another
// variant): the HEAD then goes its usual way.
func (e *Engine) headFromFlight(req *http.Request, rule *Rule, body []byte) (*http.Response, bool, error) {
	getKey, err := rule.keyer.Key(http.MethodGet, req.URL, req.Header, principalOf(req.Context()), body)
	if err != nil {
		return nil, false, nil
	}
	f, err := e.await(req, getKey)
	if f == nil {
		return nil, err != nil, err
	}
	defer e.flights.leave(f, false)
	res := f.res
	if meta := res.meta(); meta == nil || !meta.varyMatches(req.Header) {
		return nil, false, nil
	}
	if res.entry != nil {
		resp, ok := e.serve(req, res.entry, getKey, CacheCoalesced, false)
		return resp, ok, nil
	}
	resp, ok := e.streamResponse(req, res.obj.meta, http.NoBody, res.obj.size, getKey, CacheCoalesced)
	return resp, ok, nil
}

// await attaches req to the flight running under key, if any, and waits
// for its result: nil and no error when none runs; nil and an error when
// req's client left first (the flight left again). The caller leaves a
// flight it got.
func (e *Engine) await(req *http.Request, key string) (*flight, error) {
	f := e.flights.attach(key)
	if f == nil {
		return nil, nil
	}
	select {
	case <-f.ready:
		return f, nil
	case <-req.Context().Done():
		e.flights.leave(f, false)
		return nil, &Error{Cache: CacheCoalesced, Key: key, Err: req.Context().Err()}
	}
}

// bodilessKey is the X-Cache-Key reported for a BYPASS whose body was not
// read: it covers everything but the body ("" if the URL cannot be keyed).
func (e *Engine) bodilessKey(rule *Rule, req *http.Request) string {
	key, _ := rule.keyer.Key(req.Method, req.URL, req.Header, principalOf(req.Context()), nil)
	return key
}

// readBody buffers a request body up to dedup.max_request_body_bytes so it
// can be keyed and replayed. tooBig means the body is larger: req.Body then
// still yields every byte, for a BYPASS.
func (e *Engine) readBody(req *http.Request) (body []byte, tooBig bool, err error) {
	if req.Body == nil || req.Body == http.NoBody {
		return nil, false, nil
	}
	limit := int64(e.cfg.MaxRequestBodyBytes)
	if req.ContentLength > limit {
		return nil, true, nil
	}
	buf, rest, err := readLimited(req.Body, limit, req.ContentLength)
	if err != nil {
		return nil, false, err
	}
	if rest != nil {
		req.Body = rest
		return nil, true, nil
	}
	req.Body.Close()
	setBody(req, buf)
	return buf, false, nil
}

func setBody(req *http.Request, body []byte) {
	req.ContentLength = int64(len(body))
	if len(body) == 0 {
		// An HTTP/2 GET without END_STREAM on its HEADERS ends up here,
		// on every request: no readers to allocate for no bytes.
		req.Body = http.NoBody
		req.GetBody = noBody
		return
	}
	req.Body = io.NopCloser(bytes.NewReader(body))
	req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
}

func noBody() (io.ReadCloser, error) { return http.NoBody, nil }

// readLimited reads r up to limit bytes. If r holds more, rest is a body
// that replays what was read and then continues with r (and closes r).
// size is the declared length (-1 unknown): a known one is read into a
// buffer of exactly that size instead of a doubling one.
func readLimited(r io.ReadCloser, limit, size int64) (buf []byte, rest io.ReadCloser, err error) {
	if size >= 0 && size <= limit {
		buf = make([]byte, size)
		if _, err := io.ReadFull(r, buf); err != nil {
			return nil, nil, err
		}
		// A peer that sends more than it declared gets the usual error
		// from net/http; nothing more to read here.
		return buf, nil, nil
	}
	buf, err = io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return nil, nil, err
	}
	if int64(len(buf)) <= limit {
		return buf, nil, nil
	}
	return nil, &prefixedBody{Reader: io.MultiReader(bytes.NewReader(buf), r), c: r}, nil
}

type prefixedBody struct {
	io.Reader
	c io.Closer
}

func (b *prefixedBody) Close() error { return b.c.Close() }

// fromCache answers req from the store when it can. A HEAD may be answered
// from a cached GET of the same URL. Otherwise it returns the key a flight
// for req must use: key itself, or the key of req's variant when key holds
// another variant of a response that varies (Vary).
func (e *Engine) fromCache(req *http.Request, rule *Rule, key string, body []byte) (_ *http.Response, flightKey string, ok bool) {
	ent, found, flightKey := e.find(req.Context(), req, key, e.peek)
	if ent == nil && req.Method == http.MethodHead {
		// The whole store, shared tier included: no flight for the GET
		// key would look there for this HEAD.
		if getKey, err := rule.keyer.Key(http.MethodGet, req.URL, req.Header, principalOf(req.Context()), body); err == nil {
			ent, found, _ = e.find(req.Context(), req, getKey, e.store.Get)
		}
	}
	if ent == nil {
		return nil, flightKey, false
	}
	resp, ok := e.serve(req, ent, found, CacheHit, true)
	return resp, flightKey, ok
}

// find looks req up under key and, when key holds a response that varies
// on headers req sends other values of, under the key of req's variant.
// It returns the matching entry and where it was found, or nil and the key
// a flight for req must use. Variants live under keys of their own, so
// clients with different User-Agents (say) do not keep replacing each
// other's cached copy.
func (e *Engine) find(ctx context.Context, req *http.Request, key string, lookup func(context.Context, string) (*Entry, error)) (ent *Entry, found, flightKey string) {
	ent = e.get(ctx, key, lookup)
	if ent == nil {
		return nil, "", key
	}
	if ent.varyMatches(req.Header) {
		return ent, key, key
	}
	vkey := variantKey(key, ent.Vary, req.Header)
	if v := e.get(ctx, vkey, lookup); v != nil && v.varyMatches(req.Header) {
		return v, vkey, vkey
	}
	return nil, "", vkey
}

// get looks key up with lookup (the Store, or its tier in this process),
// then in the disk tier.
func (e *Engine) get(ctx context.Context, key string, lookup func(context.Context, string) (*Entry, error)) *Entry {
	ent, err := lookup(ctx, key)
	if err == nil {
		return ent
	}
	if !errors.Is(err, ErrNotFound) {
		e.log.Warn("cache lookup failed; going upstream", "key", key, "err", err)
	}
	if e.disk != nil {
		return e.disk.get(key)
	}
	return nil
}

// coalesce makes req wait on the flight for key, starting it if none is
// running. The first caller leads: its fetch runs detached from its client,
// so a leader that disconnects never cancels what others wait for.
//
// variant is set for a flight on a variant key: its result is not split
// into variants again.
func (e *Engine) coalesce(req *http.Request, rule *Rule, key string, body []byte, variant bool) (*http.Response, error) {
	f, leader, settled, err := e.ride(req, rule, key, body)
	if err != nil {
		return nil, err
	}
	if !leader && refusedForItsClient(f.res) {
		// The leader's client was over its own max_flights_per_client:
		// no answer for this one, which is not. It runs the fetch itself
		// (the failed flight is unlisted) or joins the one that does.
		// Once: a second refusal in a row is another client's again, at
		// the same microsecond, and is answered as it is.
		e.flights.leave(f, false)
		if f, leader, settled, err = e.ride(req, rule, key, body); err != nil {
			return nil, err
		}
	}
	res := f.res
	if meta := res.meta(); meta != nil && !meta.varyMatches(req.Header) {
		e.flights.leave(f, leader)
		// The response varies on a header this client sent another
		// value of: it belongs to another variant. Fetch ours, with
		// whoever else wants the same one.
		if variant {
			return e.bypass(req, key)
		}
		return e.coalesce(req, rule, variantKey(key, meta.Vary, req.Header), body, true)
	}
	return e.answer(req, key, f, res, leader, labelOf(res, leader, settled))
}

// labelOf is the X-Cache of an answer from flight result res: the
// leader's own label, HIT for a result found cached, and COALESCED for
// whoever waited on it. A request that came once a whole entry was here,
// while the flight was still telling the fleet (settled), waited on
// nothing: it is a hit.
func labelOf(res *flightResult, leader, settled bool) string {
	switch {
	case leader || res.label == CacheHit:
		return res.label
	case settled:
		return CacheHit
	}
	return CacheCoalesced
}

// ride joins the flight for key, starting it with req (which leads) when
// none runs, and waits for its result: f with leader, or an error when
// req's client left first (the flight left again). settled: f had the
// whole response already, and was only telling the fleet (see endLease,
// download.run). The caller leaves f.
func (e *Engine) ride(req *http.Request, rule *Rule, key string, body []byte) (f *flight, leader, settled bool, err error) {
	if err := req.Context().Err(); err != nil {
		// The client is gone already (it hung up while its head was read,
		// or while it waited for a Range's length): a flight it led would
		// fetch for nobody, detached, holding a flight slot.
		return nil, false, false, &Error{Cache: CacheCoalesced, Key: key, Err: err}
	}
	f, leader = e.flights.join(key)
	// Counted once join has registered us with the flight, never before:
	// a waiter the stats show gets this flight's answer, not a later one's.
	// A leader is counted before its flight starts, which may run here.
	e.st.waiters.Add(1)
	defer e.st.waiters.Add(-1)
	if leader && !e.start(f, req, rule, key, body) {
		e.flights.publish(f, &flightResult{err: errShuttingDown})
	}
	if !leader {
		select {
		case <-f.ready:
			settled = f.res.end.lease != nil || f.res.obj != nil && f.res.obj.body.complete()
		default:
		}
	}
	select {
	case <-f.ready:
		// A leader whose client left during the flight it ran here
		// answers nobody: it leaves, as it would have while waiting.
		if !leader || req.Context().Err() == nil {
			return f, leader, settled, nil
		}
	case <-req.Context().Done():
	}
	if res := e.flights.leave(f, leader); res != nil && leader && res.stream != nil {
		// Nobody will read the leader's oversized stream now.
		res.stream.Body.Close()
	}
	return nil, false, false, &Error{Cache: CacheCoalesced, Key: key, Err: req.Context().Err()}
}

var errShuttingDown = errors.New("dedup: shutting down")

// maxIdleWorkers bounds the flight workers kept waiting: enough for the
// misses a loaded instance starts at once.
const maxIdleWorkers = 256

// start runs f's fetch, and returns once f has its result or, for a
// leader whose client can leave on its own, at once. false: the engine is
// closed.
//
// Which goroutine fetches follows from how the leader's client can leave.
// An HTTP/1.x client cancels a request only by closing its connection: its
// handler has nothing else to serve, so the fetch runs right here: a miss
// pays no hand-off to another goroutine and back, and nothing asks the
// leader's context whether its client left, so the lean loop never starts
// its watch for that (proxy/h1loop.go) while the origin takes its time. On
// an origin that answers after 200ms, with 512 clients, that took a
// unique https miss from 160 to 127 µs of CPU (old and new builds in
// alternating rounds); on one that answers at once, 1–2 µs of about 50.
// An HTTP/2 client resets one stream and goes on with the others, and
// net/http bounds the handlers a connection may have running: a handler
// held by a flight after its stream is gone would stall that client's new
// requests (a browser resets streams on every navigation). So an HTTP/2
// leader's flight runs on a worker, and the leader returns as soon as its
// client leaves (TestLeaderDisconnectDoesNotCancelFlight). Either way the
// fetch is detached from the leader's client.
func (e *Engine) start(f *flight, req *http.Request, rule *Rule, key string, body []byte) bool {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return false
	}
	e.wg.Add(1)
	e.mu.Unlock()
	if req.ProtoMajor == 1 {
		e.fly(f, req, rule, key, body, false)
		return true
	}
	e.workers.Go(func() { e.fly(f, req, rule, key, body, true) })
	return true
}

// fly is a flight's life: the fetch until the response headers (a small
// body with them), then, for a response read whole under a fleet lease,
// handing it to the fleet's store once its clients have it (endLease),
// or for a streamed body, the download that fills its spool. What follows
// the result's publication runs on a worker (onWorker: here), never on
// the leader's goroutine: the leader has its answer to send.
func (e *Engine) fly(f *flight, req *http.Request, rule *Rule, key string, body []byte, onWorker bool) {
	res, dl := e.lead(req, rule, key, body)
	sharing := res.end.lease != nil
	if sharing {
		e.sharingBegins()
	}
	e.flights.publish(f, res)
	if !sharing && dl == nil {
		e.wg.Done()
		return
	}
	rest := func() {
		defer e.wg.Done()
		if sharing {
			e.endLease(f, key, res.entry, res.end)
		}
		if dl != nil {
			dl.run(f)
		}
	}
	if onWorker {
		rest()
		return
	}
	// Close waits for e.wg, still held, before it closes the pool.
	e.workers.Go(rest)
}

// endLease shares the entry a flight fetched with the fleet once its
// clients here have it: the store's round trip (the value written, the
// waiters elsewhere woken) is not theirs to wait for. With Redis on the
// same two cores that took unique misses from 6,250–6,360 to 7,180–8,000
// per second, and 230–237 µs of CPU each to 183–207 (BenchmarkStores:
// fewer requests waiting means fuller batches). Until it
// is done the flight stays listed, so that a request here for the same key
// takes the answer from it (settled) rather than ask the store, which
// still holds the lease; and it keeps its max_flights slots, so that
// flights_in_progress counts it.
func (e *Engine) endLease(f *flight, key string, ent *Entry, end leaseEnd) {
	if end.slots != nil {
		defer end.slots() // after sharingEnds, for the same reason
	}
	defer e.sharingEnds(f)
	defer func() {
		if p := recover(); p != nil {
			e.log.Error("panic sharing a flight's outcome; recovered", "key", key, "panic", p, "stack", string(debug.Stack()))
			end.lease.Release()
		}
	}()
	e.keepEntry(e.settling(), key, ent, end.ttl, end.lease)
}

// sharingBegins counts a flight whose clients are about to see its
// answer while the fleet's store has yet to take it (flights_sharing):
// before they can see it, so that nobody who has the answer reads 0.
func (e *Engine) sharingBegins() { e.st.sharing.Add(1) }

// sharingEnds ends what sharingBegins counted, once the store has the
// answer: the flight leaves the registry first, then the count, so that
// whoever sees the count drop finds the flight gone and the store holding
// the value.
func (e *Engine) sharingEnds(f *flight) {
	e.flights.unlist(f)
	e.st.sharing.Add(-1)
}

// answer turns a flight's result into this caller's response, labelled
// xcache (labelOf).
func (e *Engine) answer(req *http.Request, key string, f *flight, res *flightResult, leader bool, xcache string) (*http.Response, error) {
	if res.obj != nil {
		// The reader leaves the flight when its client is done with it.
		if resp, ok := e.serveObject(req, f, res.obj, key, xcache); ok {
			return resp, nil
		}
		e.flights.leave(f, leader)
		return e.bypass(req, key)
	}
	e.flights.leave(f, leader)
	switch {
	case res.fetchOwn:
		return e.bypass(req, key)
	case res.err != nil:
		e.count(xcache)
		return nil, &Error{Cache: xcache, Key: key, Err: res.err}
	case res.stream != nil:
		if !leader {
			// The response was too large to share; fetch our own.
			return e.bypass(req, key)
		}
		e.count(CacheBypass)
		markCache(res.stream.Header, CacheBypass, key)
		return res.stream, nil
	}
	if resp, ok := e.serve(req, res.entry, key, xcache, false); ok {
		return resp, nil
	}
	return e.bypass(req, key)
}

// serve builds one client's response from an entry, decoding the body if
// the client does not accept the stored coding. ok is false when it cannot
// (unknown coding, a disk-tier file evicted meanwhile): the caller then
// fetches for this client.
//
// sole says the caller looked ent up for this response alone: an entry the
// memory store unpacked for it (private) then lends the response its
// header map instead of a copy (a hit's largest allocation). Entries a
// flight shares with its waiters are never sole.
func (e *Engine) serve(req *http.Request, ent *Entry, key, xcache string, sole bool) (*http.Response, bool) {
	if ent.file != nil {
		return e.serveFile(req, ent, key, xcache)
	}
	body, header, err := decodeFor(ent, req.Header.Values("Accept-Encoding"), int64(e.cfg.MaxBodyBytes)*8)
	if err != nil {
		e.log.Warn("cannot serve stored response to this client", "key", key, "err", err)
		return nil, false
	}
	if header == nil && sole && ent.private {
		header = ent.Header
	}
	resp := ent.response(req, body, header)
	markCache(resp.Header, xcache, key)
	if xcache == CacheHit {
		resp.Header.Set("Age", age(ent))
	}
	e.tallyAnswer(req, ent, xcache, len(ent.Body))
	return resp, true
}

// tallyAnswer counts one client's answer of n body bytes to a response
// meta describes. A HIT or COALESCED spared upstream those bytes, but for
// a HEAD, which would have fetched none (a HEAD answered from a GET must
// not count the GET's body as saved); a MISS (the leader of a whole
// object's flight for bytes=0- included) spared nothing.
func (e *Engine) tallyAnswer(req *http.Request, meta *Entry, xcache string, n int) {
	avoided := 0
	if (xcache == CacheHit || xcache == CacheCoalesced) && req.Method != http.MethodHead {
		avoided = n
	}
	e.tally(req, xcache, avoided, e.moneySaved(meta, xcache, avoided))
}

// moneySaved prices an answer that spared an upstream request (HIT,
// COALESCED) and avoided bytes of the response meta describes, at the
// price of the upstream that fetched it.
func (e *Engine) moneySaved(meta *Entry, xcache string, avoided int) int64 {
	if xcache != CacheHit && xcache != CacheCoalesced {
		return 0
	}
	return nano(e.pricing.Load().prices.PriceOf(meta.Header.Get(headerUpstream)).saved(avoided))
}

func age(ent *Entry) string {
	return strconv.FormatInt(int64(time.Since(ent.StoredAt)/time.Second), 10)
}

// count records one response's outcome that saved nothing, here and for
// the fleet.
func (e *Engine) count(xcache string) { e.countSaved(xcache, 0, 0) }

// countSaved records one response's outcome and the money it saved.
func (e *Engine) countSaved(xcache string, avoided int, moneyNano int64) {
	e.st.answers.Record(xcache, avoided, moneyNano)
	if e.rec != nil {
		e.rec.Record(xcache, avoided, moneyNano)
	}
}

// tally counts one client's response (countSaved); a body read by another
// instance's flight is not a client's request and counts nothing here:
// its readers there count.
func (e *Engine) tally(req *http.Request, xcache string, avoided int, moneyNano int64) {
	if isPeerRead(req.Context()) {
		return
	}
	e.countSaved(xcache, avoided, moneyNano)
}

// headerUpstream names the upstream session that fetched a response (set
// by the upstream pool, stored with the entry): it picks the price.
const headerUpstream = "X-Onceproxy-Upstream"

func markCache(h http.Header, xcache, key string) {
	if vs, ok := cacheValues[xcache]; ok {
		h[HeaderCache] = vs
	} else {
		h.Set(HeaderCache, xcache)
	}
	if key != "" {
		h.Set(HeaderCacheKey, key)
	} else {
		h.Del(HeaderCacheKey)
	}
}

// cacheValues are X-Cache's values, one slice each shared by every answer
// (markCache runs for every request: a Set would allocate one apiece).
// Their capacity is their length, so an Add to a response's X-Cache copies
// instead of writing into the shared array; nothing writes into them.
var cacheValues = map[string][]string{
	CacheHit:       {CacheHit},
	CacheCoalesced: {CacheCoalesced},
	CacheMiss:      {CacheMiss},
	CacheBypass:    {CacheBypass},
}

// bypass sends req upstream without deduplication and streams the answer.
func (e *Engine) bypass(req *http.Request, key string) (*http.Response, error) {
	e.count(CacheBypass)
	e.st.upstream.Add(1)
	resp, err := e.next.RoundTrip(req)
	if err != nil {
		return nil, &Error{Cache: CacheBypass, Key: key, Err: err}
	}
	markCache(resp.Header, CacheBypass, key)
	return resp, nil
}

// lead is the flight: the one upstream fetch for key, until its response
// headers. A body comes back as res.obj, with dl, the download that fills
// it, for the caller to run; dl takes over the flight's slots, deadline
// and lease. It never panics: a panic in a flight is every waiter's error,
// not the process's end.
func (e *Engine) lead(req *http.Request, rule *Rule, key string, body []byte) (res *flightResult, dl *download) {
	defer func() {
		if p := recover(); p != nil {
			e.log.Error("panic in a flight; recovered", "key", key, "panic", p, "stack", string(debug.Stack()))
			res, dl = &flightResult{err: fmt.Errorf("internal error in flight: %v", p)}, nil
		}
	}()
	client := clientinfo.From(req.Context()).Client
	e.mu.Lock()
	if e.perClient[client] >= e.cfg.MaxFlightsPerClient {
		e.mu.Unlock()
		return &flightResult{err: overloadError{max: e.cfg.MaxFlightsPerClient, perClient: true}, label: CacheMiss}, nil
	}
	e.perClient[client]++
	e.mu.Unlock()
	unclaim := func() {
		e.mu.Lock()
		if e.perClient[client]--; e.perClient[client] <= 0 {
			delete(e.perClient, client)
		}
		e.mu.Unlock()
	}
	if n := e.st.flights.Add(1); n > int64(e.cfg.MaxFlights) {
		e.st.flights.Add(-1)
		unclaim()
		return &flightResult{err: overloadError{max: e.cfg.MaxFlights}, label: CacheMiss}, nil
	}
	// The slots stay taken while the body downloads: that is upstream
	// work too.
	slots := func() {
		e.st.flights.Add(-1)
		unclaim()
	}
	defer func() {
		switch {
		case dl != nil: // the download gives them back
		case res != nil && res.end.lease != nil:
			res.end.slots = slots // given back once the lease has ended
		default:
			slots()
		}
	}()

	// Another flight may have filled the cache between our lookup and
	// winning this one (with a Fleet, Join checks the shared tier).
	if ent := e.get(e.base, key, e.peek); ent != nil && ent.varyMatches(req.Header) {
		return &flightResult{entry: ent, label: CacheHit}, nil
	}
	label := CacheMiss
	var lease Lease
	var peer *Peer // the instance to read the body from
	if e.fleet != nil {
		var out *Outcome
		var err error
		lease, out, err = e.joinFleet(req.Context(), key)
		switch {
		case out != nil && out.IsTooLarge() && out.Peer != nil && e.peers != nil:
			peer = out.Peer
		case out != nil:
			return fleetResult(out), nil
		case errors.Is(err, ErrUnavailable):
			label = CacheBypass
		case err != nil:
			// Waited past the deadline on a flight elsewhere: fetch
			// ourselves rather than fail the clients.
			e.log.Warn("gave up waiting on another instance's flight; fetching", "key", key, "err", err)
		}
	}
	if lease != nil {
		// A panic below must not leave the fleet waiting for a lease
		// that nobody will finish. A download finishes it itself, fly
		// a result's end.
		defer func() {
			if dl == nil && (res == nil || res.end.lease == nil) {
				lease.Release()
			}
		}()
	}

	life, cancel := context.WithCancelCause(e.base)
	ctx := within(life, req.Context())
	timeout := timeoutError{e.cfg.FlightTimeout}
	// The deadline covers the fetch until the response headers. The body
	// is bounded by stall_timeout (no byte for that long ends it) and
	// max_object_bytes instead: a 2 GB download may take longer than a
	// page.
	timer := time.AfterFunc(e.cfg.FlightTimeout, func() { cancel(timeout) })
	release := func() {
		timer.Stop()
		cancel(nil)
	}
	// stalling: the timer, stopped once the headers came, times the
	// stalls of a small body read whole (see readSmall); its firing says
	// stall_timeout then, not flight_timeout.
	stalling := false
	fail := func(err error) *flightResult {
		isTimeout := !stalling && errors.Is(context.Cause(ctx), timeout)
		if isTimeout && !errors.Is(err, timeout) {
			err = fmt.Errorf("%w (%v)", timeout, err)
		}
		release()
		if lease != nil {
			e.finishLease(e.base, lease, key, Outcome{Err: err.Error(), Timeout: isTimeout || isTimeoutErr(err)}, 0)
		}
		return &flightResult{err: err, label: label}
	}

	// The upstream pool keeps a logical request on one session across
	// retries and re-queues: tell it which request this is.
	info := clientinfo.From(ctx)
	info.Key = key
	out := req.Clone(clientinfo.With(ctx, info))
	if body != nil {
		setBody(out, body)
	}
	var resp *http.Response
	// What the origin answers from now on may predate an invalidation
	// made while it comes (invalidatedSince).
	asked := time.Now()
	if peer != nil {
		// Its flight is ours: the body streams from the peer into our
		// spool, for every local reader, and is cached here. A peer that
		// cannot serve it costs one download from the origin, never an
		// error.
		if resp = e.askPeer(ctx, key, *peer, req.Header.Get("Range") != ""); resp != nil {
			label = CacheCoalesced
		}
	}
	if resp == nil {
		e.st.upstream.Add(1)
		var err error
		if resp, err = e.next.RoundTrip(out); err != nil {
			return fail(err), nil
		}
	}
	fromPeer := peer != nil && label == CacheCoalesced
	var peerVary []HeaderValue
	if fromPeer {
		peerVary = peerHeaders(resp.Header)
	}
	size := resp.ContentLength
	if req.Method == http.MethodHead || !httpstatus.BodyAllowed(resp.StatusCode) {
		// Content-Length describes the body a GET would get; there is none.
		size = 0
	}
	if size > int64(e.cfg.MaxObjectBytes) {
		return e.streamResult(resp, timer, release, lease), nil
	}
	meta, ttl := e.metaFor(req, rule, resp)
	meta.asked = asked
	if fromPeer {
		// The body is the leader's variant, fetched for its request's
		// values: local requests with other values go to their own.
		meta.Vary = peerVary
	}
	small := size > 0 && size <= e.smallBodyLimit() && !fromPeer
	if !timer.Stop() {
		// The deadline passed as the headers came.
		resp.Body.Close()
		return fail(timeout), nil
	}
	if small {
		// Read before the flight's result goes out (see smallBodyBytes),
		// straight into the form the memory store keeps when it will
		// keep it: the entry is final but for its body, and the store
		// takes it without a copy. It is bounded as a streamed body is:
		// no byte for stall_timeout fails it. Under flight_timeout, which
		// covers the headers only, an origin that stalled mid-body held
		// its clients for that long whatever stall_timeout said.
		meta.Header.Set("Content-Length", strconv.FormatInt(size, 10))
		var p packed
		var body []byte
		if ttl > 0 {
			p, body = packHead(key, meta, int(size))
		} else {
			body = make([]byte, size)
		}
		stalling = true
		stall := e.cfg.StallTimeout
		timer.Reset(stall)
		if err := readSmall(resp.Body, body, timer, stall); err != nil {
			if errors.Is(context.Cause(ctx), timeout) {
				err = stallError{stall}
			}
			return fail(fmt.Errorf("read upstream body: %w", err)), nil
		}
		meta.Body, meta.packed = body, p
	}
	if size == 0 {
		resp.Body.Close()
		release()
		ent := meta
		if req.Method != http.MethodHead && httpstatus.BodyAllowed(resp.StatusCode) {
			ent.Header.Set("Content-Length", "0")
		}
		return e.whole(key, ent, ttl, lease, label), nil
	}
	if small {
		release()
		return e.whole(key, meta, ttl, lease, label), nil
	}
	obj, dl := e.newDownload(key, resp, meta, ttl, ctx, cancel, release, slots, lease)
	if fromPeer {
		dl.body = e.newPeerBody(key, *peer, resp.Body, out, meta, size, obj.body)
	}
	return &flightResult{obj: obj, label: label}, dl
}

// smallBodyBytes is the largest declared body that a flight reads whole
// before answering, instead of streaming it through a spool: for a page or
// an API answer that arrives with its head, the spool, its wake-ups and a
// reader per client cost more CPU than the bytes themselves, and the first
// byte reaches the client a read later at most. A body cut short fails the
// flight with a 502 and a reason, instead of a 200 cut short.
const smallBodyBytes = 64 << 10

// smallBodyLimit is the largest body read whole: smallBodyBytes, within
// what the Store (and max_body_bytes) would keep.
func (e *Engine) smallBodyLimit() int64 {
	return min(smallBodyBytes, e.wholeLimit)
}

// readSmall reads a body of exactly len(buf) bytes into buf, to its EOF
// (an HTTP/1.1 connection goes back to its pool there), and closes it.
// Each read that brings bytes resets stall to d: the timer ends the read
// when the body stalls.
func readSmall(body io.ReadCloser, buf []byte, stall *time.Timer, d time.Duration) error {
	defer body.Close()
	size := len(buf)
	for n := 0; n < size; {
		k, err := body.Read(buf[n:])
		if k > 0 {
			n += k
			stall.Reset(d)
		}
		if err == io.EOF && n < size {
			return io.ErrUnexpectedEOF
		}
		if err != nil && n < size {
			return err
		}
	}
	var one [1]byte
	n, err := body.Read(one[:])
	switch {
	case n > 0:
		return fmt.Errorf("body longer than its Content-Length of %d bytes", size)
	case err == io.EOF:
		return nil
	case err == nil:
		// A reader may hold its EOF back for one more call.
		if n, err = body.Read(one[:]); n == 0 && err == io.EOF {
			return nil
		}
		if err == nil {
			err = fmt.Errorf("body longer than its Content-Length of %d bytes", size)
		}
	}
	return err
}

// metaFor is the cache entry of resp without its body, and how long it may
// be cached (0: not at all).
func (e *Engine) metaFor(req *http.Request, rule *Rule, resp *http.Response) (*Entry, time.Duration) {
	now := time.Now()
	ent := &Entry{Status: resp.StatusCode, Header: resp.Header, StoredAt: now}
	ent.URLKey, _ = rule.keyer.URLKey(req.URL)
	vary, varyAll := varyValues(resp.Header, req.Header)
	ent.Vary = vary
	ttl := rule.ttl
	if varyAll || !cacheable(rule, resp) {
		ttl = 0
	}
	if ttl > 0 {
		ent.ExpiresAt = now.Add(ttl)
	}
	return ent, ttl
}

// whole is the result of a flight that fetched ent whole. A response to
// cache, with a fleet lease, is shared with the fleet once the clients
// here have it (endLease); anything else is kept (or not) and told to the
// fleet first. A response that must not answer a later request (an error
// page, no-store) thus never does: the client who retries at once finds
// the flight over everywhere, and gets a fresh fetch.
func (e *Engine) whole(key string, ent *Entry, ttl time.Duration, lease Lease, label string) *flightResult {
	res := &flightResult{entry: ent, label: label}
	if lease != nil && keptTTL(ent, ttl) > 0 {
		res.end = leaseEnd{lease: lease, ttl: ttl}
	} else {
		e.keepEntry(e.base, key, ent, ttl, lease)
	}
	return res
}

// keepEntry caches a whole response and shares it with the fleet.
//
// The stores keep it until its ExpiresAt, which counts from the response
// headers (metaFor), not from now: a body that took a while to arrive
// must not leave a value behind that every reader refuses as expired (a
// PostgreSQL reader gives up on the fleet's flight over one, and fetches
// on its own). What expired while its body arrived is not stored at all;
// the lease still hands it to the flight's waiters.
func (e *Engine) keepEntry(ctx context.Context, key string, ent *Entry, ttl time.Duration, lease Lease) {
	ttl = keptTTL(ent, ttl)
	if ttl > 0 && e.invalidatedSince(key, ent) {
		ttl = 0
	}
	switch {
	case lease != nil:
		// Finish stores the value (when ttl > 0) with the outcome.
		e.finishLease(ctx, lease, key, Outcome{Entry: ent}, ttl)
	case ttl > 0:
		if err := e.store.Set(ctx, key, ent, ttl); err != nil {
			e.log.Warn("cache store failed; response served uncached", "key", key, "err", err)
		} else if e.invalidatedSince(key, ent) {
			// Invalidated while it was being stored: its delete may
			// have come first.
			_ = e.store.Delete(ctx, key)
		}
	}
}

// invalidatedSince reports whether key (or its URL) was invalidated since
// ent was asked of the origin, here or elsewhere in the fleet: it is not
// to be cached (invalidationLog). An entry with no such time (not fetched
// by a flight of this process) counts as asked at its StoredAt.
func (e *Engine) invalidatedSince(key string, ent *Entry) bool {
	if e.invalid.since(key, ent.URLKey, ent.askedAt()) {
		e.log.Info("not caching a response fetched before its invalidation", "key", key)
		return true
	}
	return false
}

// invalidatedElsewhere applies an invalidation made by another instance
// of the fleet to what this process alone holds: its disk tier, and the
// flights still fetching.
func (e *Engine) invalidatedElsewhere(inv Invalidation) {
	e.invalid.add(inv, time.Now())
	if e.disk != nil {
		e.disk.invalidated(inv)
	}
}

// settling is the context of what a flight stores once its clients have
// their answer: the fleet gets it too while the engine closes (Close
// waits for the flight; the stores bound their work with their own
// timeouts).
func (e *Engine) settling() context.Context { return context.WithoutCancel(e.base) }

// keptTTL is how long ent, cacheable for ttl from its headers, is kept
// from now on (see keepEntry).
func keptTTL(ent *Entry, ttl time.Duration) time.Duration {
	if !ent.ExpiresAt.IsZero() {
		ttl = max(min(ttl, time.Until(ent.ExpiresAt)), 0)
	}
	return ttl
}

// within returns a context that is done when life is and carries the
// values of values. A flight outlives the request that started it (other
// clients wait on its answer) but takes the request's values upstream
// (the client's fingerprint and identity), and it stops with the engine.
// context.WithoutCancel(values) and an AfterFunc on the engine's context
// did the same with four more allocations per miss and a registration in
// the engine's context.
func within(life, values context.Context) context.Context {
	return lifeValues{Context: life, values: values}
}

type lifeValues struct {
	context.Context // life: Deadline, Done, Err
	values          context.Context
}

// Value looks in life first: context.Cause and a child's cancellation
// find life's cancelation there, under a key of the context package's.
// life carries no value a request would.
func (c lifeValues) Value(key any) any {
	if v := c.Context.Value(key); v != nil {
		return v
	}
	return c.values.Value(key)
}

// joinFleet joins the fleet-wide flight for key. Waiting on another
// process is bounded by the flight timeout plus a margin, so that a slow
// but live leader normally answers before its waiters give up.
func (e *Engine) joinFleet(ctx context.Context, key string) (Lease, *Outcome, error) {
	life, cancel := context.WithTimeout(e.base, e.cfg.FlightTimeout+5*time.Second)
	defer cancel()
	return e.fleet.Join(within(life, ctx), key)
}

func (e *Engine) finishLease(ctx context.Context, lease Lease, key string, out Outcome, ttl time.Duration) {
	// No deadline of ours: Finish is bounded by the store's own timeouts
	// (Lease's contract), and a timer per miss is not free.
	if err := lease.Finish(ctx, out, ttl); err != nil {
		e.log.Warn("could not share a flight's outcome with the fleet", "key", key, "err", err)
	}
}

// fleetResult turns another process's outcome into this process's flight
// result: every local waiter, the local leader included, was coalesced.
func fleetResult(out *Outcome) *flightResult {
	label := CacheCoalesced
	if out.Cached {
		label = CacheHit
	}
	if out.IsTooLarge() {
		// Also with out.Peer: this engine has no way to fetch from a
		// peer.
		return &flightResult{fetchOwn: true}
	}
	if out.Entry == nil {
		return &flightResult{err: &remoteError{msg: out.Err, timeout: out.Timeout}, label: label}
	}
	return &flightResult{entry: out.Entry, label: label}
}

func isTimeoutErr(err error) bool {
	var t interface{ Timeout() bool }
	return errors.As(err, &t) && t.Timeout()
}

// streamResult hands a response larger than max_object_bytes to the
// leader's client alone, uncached. The flight deadline stops applying;
// closing the body releases the fetch. Waiters elsewhere in the fleet are
// told to fetch their own copy.
func (e *Engine) streamResult(resp *http.Response, timer *time.Timer, release func(), lease Lease) *flightResult {
	if lease != nil {
		e.finishLease(e.base, lease, "", TooLarge(nil), 0)
	}
	if !timer.Stop() {
		resp.Body.Close()
		release()
		return &flightResult{err: timeoutError{e.cfg.FlightTimeout}}
	}
	resp.Body = &releasingBody{ReadCloser: resp.Body, release: release}
	return &flightResult{stream: resp}
}

// errTooLarge is the outcome shared with the fleet for a response too large
// to share through the store (its body is over max_body_bytes, or did not
// stay in memory): its waiters fetch their own copy.
const errTooLarge = "response larger than dedup.max_body_bytes: fetch your own"

type releasingBody struct {
	io.ReadCloser
	once    sync.Once
	release func()
}

func (b *releasingBody) Close() error {
	err := b.ReadCloser.Close()
	b.once.Do(b.release)
	return err
}

// cacheable applies the rule and the response's own instructions. 429 and
// 5xx are never cached whatever the rule says (validation rejects them too).
func cacheable(rule *Rule, resp *http.Response) bool {
	s := resp.StatusCode
	if s == http.StatusTooManyRequests || s >= 500 || !rule.statuses[s] {
		return false
	}
	if !rule.setCookie && len(resp.Header.Values("Set-Cookie")) > 0 {
		return false
	}
	if !rule.private && hasCacheDirective(resp.Header, "no-store", "private") {
		return false
	}
	return true
}

func hasCacheDirective(h http.Header, names ...string) bool {
	for _, v := range h.Values("Cache-Control") {
		for _, d := range strings.Split(v, ",") {
			d, _, _ = strings.Cut(strings.TrimSpace(d), "=")
			for _, n := range names {
				if strings.EqualFold(d, n) {
					return true
				}
			}
		}
	}
	return false
}

// varyValues records the request's values of the headers the response
// varies on. Accept-Encoding is left out: the engine decodes per client.
// all reports "Vary: *" (never cacheable).
func varyValues(resp, req http.Header) (vals []HeaderValue, all bool) {
	for _, v := range resp.Values("Vary") {
		for _, name := range strings.Split(v, ",") {
			name = http.CanonicalHeaderKey(strings.TrimSpace(name))
			switch name {
			case "":
			case "*":
				return nil, true
			case "Accept-Encoding":
			default:
				vals = append(vals, HeaderValue{Name: name, Value: joinValues(req.Values(name))})
			}
		}
	}
	return vals, false
}

// Stats returns what deduplication saved so far.
func (e *Engine) Stats() Stats {
	s := e.st.snapshot()
	s.Currency = e.pricing.Load().currency
	s.Store = e.store.Stats()
	if e.disk != nil {
		d := e.disk.stats()
		s.Disk = &d
	}
	s.Spool = SpoolStats{
		Active:      e.spools.active.Load(),
		Files:       e.spools.files.Load(),
		MemoryBytes: e.spools.used.Load(),
		MaxMemory:   e.spools.budget,
		DiskBytes:   e.spools.diskUsed.Load(),
		MaxDisk:     e.spools.diskBudget,
	}
	return s
}

// ErrInvalidKey is returned for a string that is not an X-Cache-Key.
var ErrInvalidKey = errors.New("dedup: not a cache key")

// InvalidateKey removes one cached response by its X-Cache-Key.
func (e *Engine) InvalidateKey(ctx context.Context, key string) error {
	if !validKey(key) {
		return fmt.Errorf("%w: %q (want %s:<64 hex digits>)", ErrInvalidKey, key, keyVersion)
	}
	// Recorded before anything is removed: a flight that stores its
	// response meanwhile finds it (keepEntry), whichever goes first.
	e.invalid.add(Invalidation{Key: key}, time.Now())
	if e.disk != nil {
		e.disk.delete(key)
	}
	return e.store.Delete(ctx, key)
}

// InvalidateURL removes every cached variant of rawURL (all methods, header
// values and credentials) and returns how many entries went.
func (e *Engine) InvalidateURL(ctx context.Context, rawURL string) (int, error) {
	u, err := parseAbsURL(rawURL)
	if err != nil {
		return 0, err
	}
	seen := map[string]bool{}
	total := 0
	for _, k := range e.rules.Load().keyers() {
		uk, err := k.URLKey(u)
		if err != nil {
			return total, fmt.Errorf("dedup: invalidate %q: %w", rawURL, err)
		}
		if seen[uk] {
			continue
		}
		seen[uk] = true
		e.invalid.add(Invalidation{URLKey: uk}, time.Now())
		n, err := e.store.DeleteURL(ctx, uk)
		total += n
		if e.disk != nil {
			total += e.disk.deleteURL(uk)
		}
		if err != nil {
			return total, fmt.Errorf("dedup: invalidate %q: %w", rawURL, err)
		}
	}
	return total, nil
}

func parseAbsURL(raw string) (*url.URL, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("%w: %q: %v", ErrInvalidURL, raw, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("%w: %q is not an absolute http(s) URL", ErrInvalidURL, raw)
	}
	return u, nil
}
