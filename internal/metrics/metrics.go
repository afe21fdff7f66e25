// Package metrics is onceproxy's Prometheus instrumentation. Hot-path
// events (a request answered, a client refused) are counted here as they
// happen; totals that a component already keeps (cache size, flights,
// certificate mints, upstream sessions) are read from it at scrape time, so
// nothing is counted twice. A nil *Metrics is valid and records nothing.
package metrics

import (
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

const namespace = "onceproxy"

// Metrics holds the registry and the event-driven collectors.
type Metrics struct {
	reg          *prometheus.Registry
	requests     *prometheus.CounterVec
	duration     *prometheus.HistogramVec
	rateLimited  prometheus.Counter
	ssrfRefused  prometheus.Counter
	authFailures prometheus.Counter
	tunnels      prometheus.Counter
	// errorLog says what a scrape left out; nil says nothing.
	errorLog *slog.Logger
	// series caches the two series each answer updates, per X-Cache value
	// the engine sets and status class: resolving them by label values
	// hashes the labels (and builds the class's string) on every request.
	series [len(cacheLabels)][6]atomic.Pointer[requestSeries]
}

// cacheLabels are the x_cache label's values: the X-Cache values the
// engine sets, and none. Any other X-Cache is an origin's own (a protocol
// switch is never deduplicated, so the origin's header reaches us as is)
// and counts as none: the dedup layer never saw that answer. Taken as a
// label, a value the origin chooses would let any client mint series at
// will, and one that is not UTF-8 would make WithLabelValues panic.
var cacheLabels = [...]string{"HIT", "MISS", "COALESCED", "BYPASS", "none"}

// noneLabel is the index of "none" in cacheLabels.
const noneLabel = len(cacheLabels) - 1

type requestSeries struct {
	count prometheus.Counter
	dur   prometheus.Observer
}

// New returns metrics on a fresh registry (Go runtime and process
// collectors included). errorLog, when not nil, is told what a scrape
// could not gather.
func New(errorLog *slog.Logger) *Metrics {
	m := &Metrics{
		errorLog: errorLog,
		reg:      prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "requests_total",
			Help: "Requests answered, by X-Cache result (HIT, COALESCED, MISS, BYPASS, or none for answers the dedup layer never saw) and status class.",
		}, []string{"x_cache", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Name: "request_duration_seconds",
			Help:    "Time from the request reaching the proxy to the end of its response body, by X-Cache result.",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"x_cache"}),
		rateLimited: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: namespace, Name: "rate_limited_total",
			Help: "Requests refused with 429 by the per-client rate limit.",
		}),
		ssrfRefused: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: namespace, Name: "ssrf_refused_total",
			Help: "Requests and tunnels refused because the target is a private, loopback, link-local or otherwise non-public address.",
		}),
		authFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: namespace, Name: "auth_failures_total",
			Help: "Clients refused for missing or wrong credentials: a 407 (or a 429 past auth.max_failures_per_minute) on the HTTP port, a failed login or no user/password offer on the SOCKS5 port.",
		}),
		tunnels: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: namespace, Name: "tunnels_total",
			Help: "Blind tunnels opened (bypass hosts, non-HTTP protocols).",
		}),
	}
	m.reg.MustRegister(m.requests, m.duration, m.rateLimited, m.ssrfRefused, m.authFailures, m.tunnels,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Request records one answered request.
func (m *Metrics) Request(xcache string, status int, d time.Duration) {
	if m == nil {
		return
	}
	i := slices.Index(cacheLabels[:], xcache)
	if i < 0 {
		i = noneLabel
	}
	xcache = cacheLabels[i]
	class := status / 100
	if status < 100 || status > 999 {
		// Not an HTTP status: Go's HTTP/2 client takes any integer in an
		// origin's :status. One series for them all, not one per hundred
		// an origin cares to send.
		class = 0
	}
	if class < 1 || class > 5 {
		m.requests.WithLabelValues(xcache, strconv.Itoa(class)+"xx").Inc()
		m.duration.WithLabelValues(xcache).Observe(d.Seconds())
		return
	}
	rs := m.series[i][class].Load()
	if rs == nil {
		// Racing first uses resolve the same series: either may be kept.
		rs = &requestSeries{
			count: m.requests.WithLabelValues(xcache, strconv.Itoa(class)+"xx"),
			dur:   m.duration.WithLabelValues(xcache),
		}
		m.series[i][class].Store(rs)
	}
	rs.count.Inc()
	rs.dur.Observe(d.Seconds())
}

// RateLimited counts a 429 from the client rate limit.
func (m *Metrics) RateLimited() {
	if m != nil {
		m.rateLimited.Inc()
	}
}

// SSRFRefused counts a refused private target.
func (m *Metrics) SSRFRefused() {
	if m != nil {
		m.ssrfRefused.Inc()
	}
}

// AuthFailed counts a client refused for its credentials, on either door.
func (m *Metrics) AuthFailed() {
	if m != nil {
		m.authFailures.Inc()
	}
}

// Tunnel counts a blind tunnel.
func (m *Metrics) Tunnel() {
	if m != nil {
		m.tunnels.Inc()
	}
}

// Register adds a collector (one reading a component's own totals).
func (m *Metrics) Register(c prometheus.Collector) {
	if m != nil {
		m.reg.MustRegister(c)
	}
}

// Gauge registers a gauge read from f at scrape time.
func (m *Metrics) Gauge(name, help string, f func() float64) {
	m.Register(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: namespace, Name: name, Help: help}, f))
}

// Counter registers a counter read from f at scrape time.
func (m *Metrics) Counter(name, help string, f func() float64) {
	m.Register(prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: namespace, Name: name, Help: help}, f))
}

// MaxScrapes is how many scrapes /metrics serves at once; one more is
// answered 503 at once (promhttp's "Limit of concurrent requests reached").
// Scrapes that overlap share one collection (their answer is as old as its
// start), so the limit bounds the encoding and compression work and the
// slots slow readers hold, not reads of the components' state: a scrape
// storm (many Prometheus replicas, a curl loop) costs the request path one
// collection at a time.
const MaxScrapes = 8

// Handler serves the registry in the Prometheus text format.
func (m *Metrics) Handler() http.Handler {
	opts := promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError, CoalesceGather: true, MaxRequestsInFlight: MaxScrapes}
	if m.errorLog != nil {
		// ContinueOnError answers 200 with the series it could gather:
		// the log is then the only place that says one is missing.
		opts.ErrorLog = slog.NewLogLogger(m.errorLog.Handler(), slog.LevelError)
	}
	return promhttp.HandlerFor(m.reg, opts)
}

// Vec is a collector of labelled values read at scrape time (upstream
// sessions: one sample per session).
type Vec struct {
	desc    *prometheus.Desc
	kind    prometheus.ValueType
	collect func(emit func(value float64, labels ...string))
}

// NewVec describes a labelled metric whose samples collect emits.
func NewVec(name, help string, counter bool, labels []string, collect func(emit func(value float64, labels ...string))) *Vec {
	kind := prometheus.GaugeValue
	if counter {
		kind = prometheus.CounterValue
	}
	return &Vec{desc: prometheus.NewDesc(namespace+"_"+name, help, labels, nil), kind: kind, collect: collect}
}

// Describe implements prometheus.Collector.
func (v *Vec) Describe(ch chan<- *prometheus.Desc) { ch <- v.desc }

// Collect implements prometheus.Collector.
func (v *Vec) Collect(ch chan<- prometheus.Metric) {
	v.collect(func(value float64, labels ...string) { v.send(ch, value, labels) })
}

// send writes one sample of v to ch.
func (v *Vec) send(ch chan<- prometheus.Metric, value float64, labels []string) {
	// Not MustNewConstMetric: its panic (a label value that is not
	// UTF-8) would end the collection, dropping every later sample with
	// the bad one, and the registry's report of it names only this type,
	// under a stack trace. An invalid metric drops the one sample and
	// names the metric.
	m, err := prometheus.NewConstMetric(v.desc, v.kind, value, labels...)
	if err != nil {
		m = prometheus.NewInvalidMetric(v.desc, fmt.Errorf("labels %q: %w", labels, err))
	}
	ch <- m
}

// Group is a collector of several metrics fed by one read of a
// component's state per scrape: read runs once, however many metrics it
// feeds (the registry would call a collector per metric, each reading the
// state again).
type Group[S any] struct {
	read func() S
	vecs []groupVec[S]
}

type groupVec[S any] struct {
	v       *Vec
	collect func(s S, emit func(value float64, labels ...string))
}

// NewGroup returns an empty group whose metrics read read's result.
func NewGroup[S any](read func() S) *Group[S] { return &Group[S]{read: read} }

// Add describes a metric of the group (as NewVec does; no labels for a
// plain gauge or counter) whose samples collect emits from the state.
func (g *Group[S]) Add(name, help string, counter bool, labels []string, collect func(s S, emit func(value float64, labels ...string))) {
	g.vecs = append(g.vecs, groupVec[S]{v: NewVec(name, help, counter, labels, nil), collect: collect})
}

// Describe implements prometheus.Collector.
func (g *Group[S]) Describe(ch chan<- *prometheus.Desc) {
	for _, gv := range g.vecs {
		ch <- gv.v.desc
	}
}

// Collect implements prometheus.Collector.
func (g *Group[S]) Collect(ch chan<- prometheus.Metric) {
	s := g.read()
	for _, gv := range g.vecs {
		gv.collect(s, func(value float64, labels ...string) { gv.v.send(ch, value, labels) })
	}
}

// Interface guards
var (
	_ prometheus.Collector = (*Vec)(nil)
	_ prometheus.Collector = (*Group[struct{}])(nil)
)
