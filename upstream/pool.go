// Package upstream is how onceproxy reaches origins: through a pool of
// upstream proxy sessions (a rotating-proxy provider's sticky, timed and
// per-request sessions, or plain proxies), or directly when none is
// configured. It exposes the standard seams: an http.RoundTripper for
// requests and a DialContext for blind tunnels.
//
// Sessions come from providers (each with its own API, priority, prices
// and countries; see providers.go) and from the configuration. The pool
// chooses a session per request: the highest-priority provider that can
// take it, in the country the request asks for (geo.go), then the client
// hint, a rule's sticky bucket (bound fleet-wide through the shared store,
// bindings.go), the request's own binding, else weighted random
// (select.go). It marks every outcome against the session (health.go) and
// its gateway, rotates a session's exit IP through the provider API after
// a 429 or a ban, and retries the request on a new exit IP or the next
// provider, all inside one RoundTrip: behind the dedup engine, every
// waiter of a flight sees only the final answer. Reconfigure (setup.go)
// applies a new configuration while it serves.
//
// A request that carries its client's fingerprint (the proxy's MITM puts
// it in the context) goes out looking like that client: over a connection
// opened with its ClientHello, HTTP version and HTTP/2 preface, with its
// header order (mirrored.go, package mirror), pooled per session and
// fingerprint. Requests without one, protocol switches and fingerprint: go
// use net/http's transports.
//
// The outgoing side never reads the process's own HTTP_PROXY / HTTPS_PROXY
// variables: a proxy that chains through whatever its environment says is a
// proxy whose egress nobody configured.
package upstream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/redact"
	"github.com/seed-a3c387e8/onceproxy/internal/urlcanon"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/upstream/mirror"
)

const (
	// HeaderUpstream names the session that answered ("direct" without
	// one). Set on every response the pool returns; never credentials.
	HeaderUpstream = "X-Onceproxy-Upstream"
	// headerSession is the client's session hint. The front door consumes
	// it; the pool strips it again so it can never reach an origin.
	headerSession = "X-Onceproxy-Session"
	headerCountry = "X-Onceproxy-Country"
	// directName is the X-Onceproxy-Upstream value of direct requests.
	directName = "direct"
)

// Pool sends requests to origins and opens tunnels to them through its
// upstream sessions, or directly when it has none configured. Create it
// with New, run its background loops with Run, release it with Close.
type Pool struct {
	log *slog.Logger
	kit *connKit
	// direct carries requests that leave from this host without the
	// client's fingerprint (RetireDirect renews it).
	direct netSet
	getenv func(string) string
	// defPrice prices sessions whose provider sets no prices (savings.*).
	defPrice dedup.Price
	// directMirror carries direct requests with the client's fingerprint.
	directMirror *mirroredTransport
	// now is the clock of marks and cooldowns; tests replace it.
	now func() time.Time

	st       atomic.Pointer[setup] // the configuration's part; Reconfigure swaps it
	sessions atomic.Pointer[sessionSet]
	bindings bindings       // logical requests' sessions, this instance's
	fleet    *fleetBindings // sticky keys' sessions, the fleet's; nil without a store for them

	reconfMu sync.Mutex // serializes Reconfigure
	// mu guards the providers' lists and state, retired, and the building
	// of session sets (refreshes and Reconfigure).
	mu      sync.Mutex
	retired []*session // left the set; idle connections closed again later
	checkMu sync.Mutex // one checkProviders at a time

	reconf     chan struct{} // tells Run's refresh supervisor the providers changed
	healthKick chan struct{}

	exhausted atomic.Bool // inside an "every session is cooling" episode (logged once)

	bus           Bus // nil: this instance learns alone
	notesRejected atomic.Int64
}

// Option adjusts a Pool at construction.
type Option func(*options)

type options struct {
	control func(ctx context.Context, network, address string, c syscall.RawConn) error
	lookup  LookupFunc
	bus     Bus
	getenv  func(string) string
	price   dedup.Price
}

// WithDialControl sets the net.Dialer ControlContext of connections the
// pool opens directly to origins (not to gateways or the provider API,
// which are the operator's own addresses): the SSRF guard's dial-time check
// of the resolved address.
func WithDialControl(f func(ctx context.Context, network, address string, c syscall.RawConn) error) Option {
	return func(o *options) { o.control = f }
}

// WithLookup sets how the pool resolves the host names of the connections
// it opens directly to origins (requests and tunnels alike; gateways and
// the provider API are the operator's own addresses and are dialled as
// usual). Default: net.DefaultResolver.LookupNetIP.
func WithLookup(f LookupFunc) Option {
	return func(o *options) { o.lookup = f }
}

// WithGetenv sets how the pool reads the environment variables the
// configuration names (provider.api_key_env): the environment the program
// was given. Default os.Getenv.
func WithGetenv(getenv func(string) string) Option {
	return func(o *options) { o.getenv = getenv }
}

// WithPrices sets what a request costs through a provider that sets no
// prices of its own, and directly: the savings section. Default nothing.
func WithPrices(c dedup.SavingsConfig) Option {
	return func(o *options) { o.price = c.PriceOf(directName) }
}

// New builds a Pool from cfg (defaults applied here). It starts no
// goroutine. With providers configured it fetches their session lists once,
// in parallel, bounded by each one's timeout; a provider whose fetch fails
// is logged and serves nothing until a refresh by Run succeeds (the others
// serve meanwhile, or the pool answers 503 "no upstream sessions yet").
func New(cfg Config, logger *slog.Logger, opts ...Option) (*Pool, error) {
	o := options{getenv: os.Getenv}
	for _, opt := range opts {
		opt(&o)
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(o.getenv); err != nil {
		return nil, fmt.Errorf("upstream: %w", err)
	}
	tlsConf, err := originTLSConfig(cfg, logger)
	if err != nil {
		return nil, fmt.Errorf("upstream: %w", err)
	}
	kit := &connKit{cfg: cfg, tls: tlsConf,
		dialer: &net.Dialer{Timeout: cfg.DialTimeout, KeepAlive: 30 * time.Second},
		direct: &net.Dialer{Timeout: cfg.DialTimeout, KeepAlive: 30 * time.Second, ControlContext: o.control},
		lookup: o.lookup,
		alpn:   newALPNMemory(),
		log:    logger,
	}
	if kit.lookup == nil {
		kit.lookup = net.DefaultResolver.LookupNetIP
	}
	p := &Pool{
		log:        logger,
		kit:        kit,
		getenv:     o.getenv,
		defPrice:   o.price,
		now:        time.Now,
		bus:        o.bus,
		reconf:     make(chan struct{}, 1),
		healthKick: make(chan struct{}, 1),
	}
	if b, ok := o.bus.(Bindings); ok {
		p.fleet = &fleetBindings{store: b, local: &bindings{ttl: fleetLocalTTL}}
	}
	p.direct.init(func() *netTransports {
		nt := new(netTransports)
		nt.tls = kit.transport(nt.counted(kit.dialDirect), nil, true, cfg.IdleConnTimeout)
		nt.plain = nt.tls
		return nt
	})
	p.directMirror = kit.mirroredTransport(kit.dialDirect, true, true, cfg.IdleConnTimeout)
	st, fresh, err := p.build(cfg, nil)
	if err != nil {
		return nil, err
	}
	p.st.Store(st)
	lists := make([]fetched, len(fresh))
	var wg sync.WaitGroup
	for i, pv := range fresh {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), pv.cfg.Timeout)
			defer cancel()
			lists[i] = p.fetchList(ctx, pv)
		})
	}
	wg.Wait()
	p.mu.Lock()
	for i, pv := range fresh {
		p.applyList(pv, lists[i], st)
	}
	p.rebuild(st)
	p.mu.Unlock()
	for i, pv := range fresh {
		if err := lists[i].err; err != nil {
			// retry_after is what the API asked; next_try what it gets
			// (MaxFirstListWait at most, for a first list).
			p.mu.Lock()
			next := pv.nextTry(p.now()).Sub(p.now()).Round(time.Second)
			p.mu.Unlock()
			if len(p.sessions.Load().list) == 0 {
				logger.Error("upstream provider API failed at start-up and it is the only source of sessions: "+
					"requests get 503 until a refresh succeeds", "provider", pv.name, "err", err, apiWaitAttr(err), "next_try", next)
			} else {
				logger.Error("upstream provider API failed at start-up; serving the other sessions until a refresh succeeds",
					"provider", pv.name, "sessions", len(p.sessions.Load().list), "err", err, apiWaitAttr(err), "next_try", next)
			}
		}
	}
	p.initProviders()
	if !st.isDirect && cfg.WhenExhausted == ExhaustedDirect {
		logger.Warn("upstream.when_exhausted=direct: when every session is cooling down, requests leave from this host's own IP")
	}
	if p.bus != nil {
		// Last: the recalled cooldowns apply to the sessions known by now.
		p.bus.Subscribe(sessionTopic, p.hear)
		if p.fleet != nil {
			p.bus.Subscribe(bindingTopic, p.hearMove)
		}
	}
	return p, nil
}

// RoundTrip sends req through a session and returns the final answer: a
// 429, a ban or a 5xx is retried (up to retry.max_attempts, for the rule's
// retry methods) on a new exit IP before anything is returned. It
// implements http.RoundTripper.
func (p *Pool) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := p.roundTrip(req)
	if err == nil {
		streamIdle(resp, p.st.Load().cfg.IdleTimeout)
	}
	return resp, err
}

func (p *Pool) roundTrip(req *http.Request) (*http.Response, error) {
	st := p.st.Load()
	host := req.URL.Hostname()
	r := st.match(host, urlcanon.Path(req.URL))
	if st.isDirect {
		return p.sendDirect(req, r)
	}
	ctx := req.Context()
	info := clientinfo.From(ctx)
	pr := r.pickRequest(info, host)
	pr.site = urlSite(req.URL)
	replayable := rewindable(req)
	var (
		tried   []*session
		rotated *session // a tried session whose exit IP changed since its failure
		misses  targetMisses
	)
	for attempt := 1; ; attempt++ {
		now := p.now()
		set := p.sessions.Load()
		s := p.pick(ctx, set, &pr, now, tried)
		if s == nil && rotated != nil {
			// Nothing else is available, but this session has a new exit
			// IP that has not been rate-limited: its cooldown was for the
			// old one.
			s, rotated = rotated, nil
		}
		if s == nil {
			// Later attempts get here only if the session seen available
			// a moment ago went into cooldown meanwhile.
			return p.whenExhausted(req, st, r, set, &pr, now)
		}
		p.endExhaustion()
		out, err := outgoing(req, attempt)
		if err != nil {
			return nil, fmt.Errorf("upstream: replay request body: %w", err)
		}
		gen, since := s.gen.Load(), s.h.epoch()
		resp, err := s.roundTrip(s.transportFor(out, r.mirror), out)
		v, bodyErr := p.classify(ctx, r, out, resp, err)
		if bodyErr != nil {
			// The body died while it was read for a ban signal: the
			// response is no answer to give (its body is closed).
			resp, err = nil, bodyErr
		}
		if v.target {
			p.gatewayOutcome(s, verdict{kind: outcomeOK}, nil) // the gateway answered
			tried = append(tried, s)
			// A session rotated after a 429 is still to be tried: the
			// loop falls back to its new exit IP.
			if !misses.add(s, v.msg, v.uncharged, since, pr.site) || attempt >= st.cfg.Retry.MaxAttempts || !replayable ||
				rotated == nil && !anyUsable(p.sessions.Load(), &pr, p.now(), tried) {
				return p.answer(s, nil, err)
			}
			p.log.Info("upstream gateway cannot reach the target; retrying once on another session", "session", s.id,
				"detail", s.scrub(v.msg), "attempt", attempt, "host", req.URL.Host, "path", redact.Path(req.URL.Path))
			continue
		}
		if v.unsure {
			// A hanging or failing origin, or this session: not known
			// yet. Charged once another session reaches the origin;
			// never when none does (one dead site must not bench the
			// pool for every other one). Its gateway did set it up.
			p.gatewayOutcome(s, v, err)
			tried = append(tried, s)
			if !misses.add(s, v.msg, false, since, pr.site) || attempt >= st.cfg.Retry.MaxAttempts || !replayable ||
				!r.retries(req.Method) || rotated == nil && !anyUsable(p.sessions.Load(), &pr, p.now(), tried) {
				return p.answer(s, nil, err)
			}
			p.log.Info("upstream attempt failed, the origin or the session; retrying once on another session", "session", s.id,
				"detail", s.scrub(v.msg), "attempt", attempt, "host", req.URL.Host, "path", redact.Path(req.URL.Path))
			continue
		}
		if resp != nil && (v.kind == outcomeOK || v.kind == outcomeBanned) {
			// The origin answered through s: the sessions whose gateway
			// said it could not reach it were at fault after all. Not on
			// a 429, which on plain http may be the gateway's own.
			misses.charge(p)
		}
		p.gatewayOutcome(s, v, err)
		p.mark(s, since, v.kind, v.retryAfter, s.scrub(v.msg), pr.site, v.site)
		if v.kind == outcomeOK || v.kind == outcomeNone {
			if v.kind == outcomeOK && pr.key != 0 {
				p.bindings.put(pr.key, s.id, now.UnixNano())
			}
			return p.answer(s, resp, err)
		}
		retry := attempt < st.cfg.Retry.MaxAttempts && replayable && (r.retries(req.Method) || v.neverSent)
		next := "another session"
		if retry && (v.kind == outcomeRateLimited || v.kind == outcomeBanned) && p.rotateAfterFailure(ctx, s, gen) {
			rotated = s
			next = "another session or its new exit IP"
		}
		tried = append(tried, s)
		if retry && rotated == nil && !anyUsable(p.sessions.Load(), &pr, p.now(), tried) {
			// Nowhere else to go: the answer we have is the final one.
			// Without an answer (every session failed to connect), say
			// why no session can take the request.
			if err != nil {
				set := p.sessions.Load()
				if ex := p.exhaustedError(set, &pr, p.now()); ex.Sessions > 0 && !anyUsable(set, &pr, p.now(), nil) {
					ex.Cause = fmt.Errorf("upstream session %s: %w", s.id, scrubbed{err, s})
					return nil, ex
				}
			}
			retry = false
		}
		if !retry {
			return p.answer(s, resp, err)
		}
		p.log.Info("upstream attempt failed; retrying", "session", s.id, "outcome", v.kind.String(),
			"detail", s.scrub(v.msg), "attempt", attempt, "host", req.URL.Host, "path", redact.Path(req.URL.Path), "next", next)
		discard(resp)
	}
}

// answer finishes a request on session s: the response carries the
// session's id, an error names it.
func (p *Pool) answer(s *session, resp *http.Response, err error) (*http.Response, error) {
	if err != nil {
		return nil, fmt.Errorf("upstream session %s: %w", s.id, scrubbed{err, s})
	}
	setUpstreamHeader(resp, s.id)
	return resp, nil
}

// scrubbed wraps an error so that its text never carries the session's
// password while errors.Is/As still see the original.
type scrubbed struct {
	err error
	s   *session
}

func (e scrubbed) Error() string { return e.s.scrub(e.err.Error()) }
func (e scrubbed) Unwrap() error { return e.err }

func setUpstreamHeader(resp *http.Response, name string) {
	if resp.Header == nil {
		resp.Header = make(http.Header)
	}
	resp.Header.Set(HeaderUpstream, name)
}

// outgoing is the request of one attempt: without the session and
// country hint headers, and with a fresh body for a retry.
func outgoing(req *http.Request, attempt int) (*http.Request, error) {
	out := req
	_, hasSession := req.Header[headerSession]
	_, hasCountry := req.Header[headerCountry]
	if hasSession || hasCountry {
		out = req.Clone(req.Context())
		out.Header.Del(headerSession)
		out.Header.Del(headerCountry)
	}
	if attempt > 1 && req.Body != nil && req.Body != http.NoBody {
		if out == req {
			out = req.WithContext(req.Context()) // shallow copy
		}
		body, err := req.GetBody()
		if err != nil {
			return nil, err
		}
		out.Body = body
	}
	return out, nil
}

// discard drops a response we will not return, reading a little of it so
// its connection can be reused.
func discard(resp *http.Response) {
	if resp == nil || resp.Body == nil {
		return
	}
	_, _ = io.CopyN(io.Discard, resp.Body, 8<<10)
	resp.Body.Close()
}

// sendDirect sends req from this host under rule r.
func (p *Pool) sendDirect(req *http.Request, r *rule) (*http.Response, error) {
	out, err := outgoing(req, 1)
	if err != nil {
		return nil, err
	}
	var tr http.RoundTripper = p.direct.current().tls
	if r.mirror && p.directMirror.takes(out) {
		tr = p.directMirror
	} else {
		out = withTEOption(out)
	}
	resp, err := tr.RoundTrip(out)
	if err != nil {
		return nil, err
	}
	setUpstreamHeader(resp, directName)
	return resp, nil
}

// whenExhausted answers a request no session can take.
func (p *Pool) whenExhausted(req *http.Request, st *setup, r *rule, set *sessionSet, pr *pickReq, now time.Time) (*http.Response, error) {
	err := p.exhaustedError(set, pr, now)
	if st.cfg.WhenExhausted == ExhaustedDirect && pr.country == "" {
		if !p.exhausted.Swap(true) {
			p.log.Error("ALL upstream sessions unavailable: sending requests DIRECT from this host's own IP "+
				"(upstream.when_exhausted=direct)", "reason", err.Reason)
		}
		return p.sendDirect(req, r)
	}
	if pr.country != "" {
		// One country's sessions being out is no episode of the pool's.
		return nil, err
	}
	if !p.exhausted.Swap(true) {
		p.log.Warn("all upstream sessions unavailable: answering 503 until one is ready", "reason", err.Reason)
	}
	return nil, err
}

func (p *Pool) endExhaustion() {
	if p.exhausted.Load() && p.exhausted.Swap(false) {
		p.log.Info("upstream sessions available again")
	}
}

// DialContext opens a byte tunnel to addr ("host:port") through a session,
// for traffic the proxy does not interpret (bypass hosts, non-HTTP
// protocols). A session that cannot open it is marked and the next one is
// tried: nothing was sent yet.
func (p *Pool) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	st := p.st.Load()
	if st.isDirect {
		return p.kit.dialDirect(ctx, network, addr)
	}
	info := clientinfo.From(ctx)
	host, port, _ := net.SplitHostPort(addr)
	r := st.match(host, "")
	pr := r.pickRequest(info, host)
	pr.site = siteOf(host, port)
	var (
		tried   []*session
		lastErr error
		misses  targetMisses
	)
	for attempt := 1; attempt <= st.cfg.Retry.MaxAttempts; attempt++ {
		now := p.now()
		set := p.sessions.Load()
		s := p.pick(ctx, set, &pr, now, tried)
		if s == nil {
			if lastErr != nil {
				return nil, lastErr
			}
			if st.cfg.WhenExhausted == ExhaustedDirect && pr.country == "" {
				if !p.exhausted.Swap(true) {
					p.log.Error("ALL upstream sessions unavailable: opening tunnels DIRECT from this host's own IP "+
						"(upstream.when_exhausted=direct)", "reason", p.exhaustedError(set, &pr, now).Reason)
				}
				return p.kit.dialDirect(ctx, network, addr)
			}
			return nil, p.exhaustedError(set, &pr, now)
		}
		p.endExhaustion()
		since := s.h.epoch()
		c, err := s.tunnel(ctx, addr)
		if err == nil {
			misses.charge(p) // the target was reachable through s
			p.gatewayOutcome(s, verdict{kind: outcomeOK}, nil)
			p.mark(s, since, outcomeOK, 0, "", pr.site, false)
			if p.log.Enabled(ctx, slog.LevelDebug) {
				p.log.Debug("tunnel through upstream session", "session", s.id, "target", addr)
			}
			return c, nil
		}
		v := classifyErr(ctx, err)
		lastErr = fmt.Errorf("upstream session %s: %w", s.id, scrubbed{err, s})
		if v.target {
			p.gatewayOutcome(s, verdict{kind: outcomeOK}, nil) // the gateway answered
			tried = append(tried, s)
			if !misses.add(s, v.msg, v.uncharged, since, pr.site) {
				return nil, lastErr
			}
			continue
		}
		p.gatewayOutcome(s, v, err)
		p.mark(s, since, v.kind, v.retryAfter, s.scrub(v.msg), pr.site, false)
		if v.kind == outcomeNone {
			return nil, lastErr
		}
		tried = append(tried, s)
	}
	return nil, lastErr
}

// targetMisses are the sessions of one request (or tunnel) whose gateway
// answered that it could not reach the target (TargetUnreachableError).
//
// The rule: such an answer is the origin's trouble until shown otherwise.
// A gateway gives it alike when the origin is down and when the session's
// exit cannot reach it, and an origin that is down must not bench every
// session it is tried on (each would get a connection error's cooldown,
// and the next requests a 503). So the session is not marked, and the
// request is tried once more, on another session: if that one reaches the
// target too, the sessions that could not are charged a connection error
// (the target was reachable, their exit was not); if it also cannot, the
// origin is taken to be unreachable and the client is answered 502 (504
// when the gateway timed out) with the gateway's reason. Gateways that
// cannot be reached, refuse our credentials or fail otherwise are the
// session's fault at once, as before.
//
// A connection that fails after its gateway set it up (verdict.unsure: a
// timeout awaiting the headers, a reset) follows the same rule, for the
// methods a rule retries: a hanging origin does that through every
// session, and one request to it used to bench two sessions for five
// minutes.
type targetMisses struct {
	n    int          // misses seen
	list []targetMiss // those to charge
}

type targetMiss struct {
	s     *session
	msg   string
	since uint64 // the session's cooldown epoch when the attempt began
	site  string
}

// maxTargetMisses is how many gateways must say the target is unreachable
// before the request is answered so: the first one and one other.
const maxTargetMisses = 2

// add records a miss of s and reports whether the request may be tried
// once more. An uncharged miss is never charged: see
// TargetUnreachableError.uncharged.
func (m *targetMisses) add(s *session, msg string, uncharged bool, since uint64, site string) bool {
	m.n++
	if !uncharged {
		m.list = append(m.list, targetMiss{s, s.scrub(msg), since, site})
	}
	return m.n < maxTargetMisses
}

// charge marks the sessions that missed a target another session reached.
func (m *targetMisses) charge(p *Pool) {
	for _, tm := range m.list {
		// As of its attempt: a cooldown that began since (a site's 429,
		// whose rotation cut this attempt's tunnel) makes it that wall.
		p.mark(tm.s, tm.since, outcomeConnError, 0, tm.msg+" (reachable through another session)", tm.site, false)
	}
	m.list = nil
}

// roundTrip sends req on tr, one of s's transports. An answer to an
// absolute-form request (plain http through an HTTP gateway, on a
// transport with a Proxy) may be the gateway's own rather than an origin's, and then becomes the
// error the same answer to CONNECT is: a 407 (its credentials are
// refused; the gateway's Proxy-Authenticate never reaches the client), and
// a 5xx whose headers say the gateway could not reach the target
// (gatewayCouldNotReach).
func (s *session) roundTrip(tr http.RoundTripper, req *http.Request) (*http.Response, error) {
	if _, ok := tr.(*http.Transport); ok {
		req = withTEOption(req)
	}
	resp, err := tr.RoundTrip(req)
	if t, ok := tr.(*http.Transport); err != nil || !ok || t.Proxy == nil {
		return resp, err
	}
	var reason string
	if resp.StatusCode >= 500 {
		reason = gatewayCouldNotReach(resp.Header)
	}
	if resp.StatusCode != http.StatusProxyAuthRequired && reason == "" {
		return resp, nil
	}
	// Its body is read for the reason only. The same answer to CONNECT
	// is under the handshake's deadline; this one's connection is
	// net/http's, and a body that stalls held the request until its
	// caller gave up, the session uncharged: closing the body ends the
	// read.
	stall := time.AfterFunc(s.answerWait, func() { resp.Body.Close() })
	var gerr error = gatewayAnswer(resp)
	stall.Stop()
	if reason != "" {
		// As for CONNECT (a 500 too says bad gateway here), and a
		// gateway that names a timeout timed out whatever its status.
		status := max(targetStatusOfConnect(resp.StatusCode), http.StatusBadGateway)
		if strings.HasSuffix(reason, "_timeout") {
			status = http.StatusGatewayTimeout
		}
		gerr = &TargetUnreachableError{Target: req.URL.Host, Status: status, Err: fmt.Errorf("%w (%s)", gerr, reason), uncharged: true}
	}
	return nil, &DialError{Op: req.Method + " " + req.URL.Host + " through upstream proxy " + s.proxyURL.Host, Err: gerr}
}

// RetireDirect retires every connection the pool opened to origins from
// this host: the idle ones close now, the busy ones once their requests
// are done, and none takes a new one. A reload that changes the SSRF
// guard calls it: the guard checks an address when it is dialled, and a
// pooled connection would otherwise go on carrying requests to an address
// the new guard refuses.
func (p *Pool) RetireDirect() {
	p.direct.renew()
	p.directMirror.closeIdle()
}

// Describe names the egress for logs, without credentials.
func (p *Pool) Describe() string {
	st := p.st.Load()
	if st.isDirect {
		return directName
	}
	set := p.sessions.Load()
	ids := make([]string, 0, len(set.list))
	for _, s := range set.list {
		ids = append(ids, s.id)
	}
	if len(ids) > 8 {
		ids = append(ids[:8], "…")
	}
	d := fmt.Sprintf("%d upstream sessions [%s]", len(set.list), strings.Join(ids, " "))
	apis := st.apiGroups()
	if len(set.list) == 1 && len(st.static) == 1 && len(apis) == 0 {
		d = "upstream session " + set.list[0].id + " via " + redact.ParsedURL(set.list[0].proxyURL)
	}
	for _, pv := range apis {
		d += fmt.Sprintf(", provider %s %s (priority %d)", pv.name, pv.client.base, pv.priority)
	}
	return d + ", when_exhausted=" + st.cfg.WhenExhausted
}

// Close drops pooled idle connections. Call it after Run has returned.
func (p *Pool) Close() {
	p.direct.closeIdle()
	p.directMirror.close()
	for _, s := range p.sessions.Load().list {
		s.close()
	}
	p.mu.Lock()
	for _, s := range p.retired {
		s.close()
	}
	p.retired = nil
	p.mu.Unlock()
}

// HelloCounts returns how many origin connections were opened with each
// kind of TLS hello: "mirrored" (the client's), "closest" (the client's
// minus what the TLS library cannot complete), "go" (Go's own: net/http's
// transports, and the mirror's last resort).
func (p *Pool) HelloCounts() map[string]int64 {
	out := make(map[string]int64, 3)
	for _, m := range []mirror.Mode{mirror.Mirrored, mirror.Closest, mirror.Go} {
		out[m.String()] = p.kit.hellos[m].Load()
	}
	return out
}

// TimedRotationMin returns the shortest rotation interval of the current
// timed sessions, and false when there is none. A cached response older
// than this may have been fetched from an exit IP the session no longer has.
func (p *Pool) TimedRotationMin() (time.Duration, bool) {
	var m time.Duration
	for _, s := range p.sessions.Load().list {
		if s.rotation == RotationTimed && (m == 0 || s.interval < m) {
			m = s.interval
		}
	}
	return m, m > 0
}

// Run runs the background work until ctx ends: the providers' refresh
// loops, the active health checks, the recycling of timed sessions'
// connections and the providers' failover watch. It returns nil once every
// goroutine it started has ended.
func (p *Pool) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	wg.Go(func() { p.superviseRefresh(ctx) })
	wg.Go(func() { p.healthLoop(ctx) })
	wg.Go(func() { p.recycleLoop(ctx) })
	wg.Go(func() { p.watchProviders(ctx) })
	<-ctx.Done()
	wg.Wait()
	return nil
}

// rotateAfterFailure rotates s through the provider after a 429 or a ban
// seen by an attempt that started at rotation generation gen. Many flights
// may hit the same wall at once: one rotation serves them all (the others
// find the generation moved). It reports whether s now has a new exit IP.
func (p *Pool) rotateAfterFailure(ctx context.Context, s *session, gen uint64) bool {
	if s.perRequest {
		// Its next connection leaves from a new IP anyway.
		return true
	}
	pv := p.rotatorOf(s)
	if pv == nil || s.notAtProvider.Load() {
		return false
	}
	select {
	case s.rotateSem <- struct{}{}:
	case <-ctx.Done():
		return false
	}
	defer func() { <-s.rotateSem }()
	if s.gen.Load() != gen {
		return true // rotated since this attempt started
	}
	if s.rotateFailGen == gen && p.now().Before(s.rotateFailUntil) {
		// The rotation this attempt waited for was tried and failed: the
		// flights queued behind it must not each call the API again.
		return false
	}
	proceed, release, rotated := p.claimRotation(ctx, s, gen, pv)
	if !proceed {
		return rotated
	}
	if s.gen.Load() != gen {
		return true // rotated (here, or by news) while we claimed it
	}
	if err := p.rotateLocked(ctx, s, pv, "after a 429 or ban"); err != nil {
		release()
		if ctx.Err() == nil {
			// The API failed, not our flight: back off for this exit IP,
			// as long as the API asked when it said so.
			s.rotateFailGen, s.rotateFailUntil = gen, p.now().Add(max(rotateFailBackoff, apiWait(err)))
		}
		if errors.Is(err, errProviderNotFound) && s.source == sourceConfig {
			// A configured plain proxy next to a provider: stop asking.
			s.notAtProvider.Store(true)
		}
		p.log.Warn("upstream session rotation failed", "session", s.id, "err", err)
		return false
	}
	return true
}

// rotateFailBackoff is how long after a failed rotation of a session the
// flights failing at the same exit IP (the same generation) do without
// one, instead of calling the provider API again one after the other: N
// concurrent 429s cost at most one rotate call per period.
const rotateFailBackoff = 10 * time.Second

// rotatorOf is the provider whose API rotates s: its own, or for a
// hand-listed session of no provider the only provider there is; nil when
// none can.
func (p *Pool) rotatorOf(s *session) *provider {
	if pv := s.prov.Load(); pv != nil && pv.client != nil {
		return pv
	}
	return p.st.Load().rotator
}

// rotateLocked calls pv's rotate API for s. Caller holds s.rotateSem.
func (p *Pool) rotateLocked(ctx context.Context, s *session, pv *provider, why string) error {
	ctx, cancel := context.WithTimeout(ctx, pv.cfg.Timeout)
	defer cancel()
	ip, err := pv.client.rotate(ctx, s.apiID)
	if err != nil {
		return err
	}
	s.rotatedTo(ip)
	s.h.rotations.Add(1)
	p.log.Info("upstream session rotated", "session", s.id, "why", why, "exit_ip", ip)
	p.publish(SessionEvent{Session: s.id, Kind: EventRotated, ExitIP: ip})
	return nil
}

// Rotate asks the provider for a new exit IP for session id (the admin
// API's POST /upstream/sessions/{id}/rotate). Errors carry HTTPStatus: 404
// for an unknown id, 409 without a provider API, 502 when the API failed.
func (p *Pool) Rotate(ctx context.Context, id string) error {
	s := p.sessions.Load().byID[id]
	if s == nil {
		return &StatusError{Status: http.StatusNotFound, Err: fmt.Errorf("upstream: no session %q", id)}
	}
	pv := p.rotatorOf(s)
	if pv == nil {
		return &StatusError{Status: http.StatusConflict, Err: fmt.Errorf("upstream: session %q cannot be rotated: no provider API for it (upstream.provider.api, or the session's provider)", id)}
	}
	select {
	case s.rotateSem <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-s.rotateSem }()
	if err := p.rotateLocked(ctx, s, pv, "admin request"); err != nil {
		st := http.StatusBadGateway
		if errors.Is(err, errProviderNotFound) {
			st = http.StatusNotFound
		}
		return &StatusError{Status: st, Err: fmt.Errorf("upstream: rotate session %q: %w", id, err)}
	}
	return nil
}
