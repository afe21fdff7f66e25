package loadgen

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Options configures [Run]. Only Targets is required.
type Options struct {
	// Proxy is the forward proxy every request goes through: plain HTTP
	// targets in absolute form, HTTPS targets through CONNECT. If nil,
	// requests go directly to the targets. The environment (HTTP_PROXY and
	// friends) is never consulted.
	Proxy *url.URL

	// CAFile is a PEM file of certificates trusted in addition to the
	// system pool: onceproxy's MITM CA when Proxy is set, a TLS origin's
	// certificate ([Origin.CAFile]) when not. If empty, only the system
	// pool is trusted.
	CAFile string

	// Targets are the distinct URLs to request, in round-robin order.
	// With a single target every request is the same: a stampede.
	Targets []string

	// N is the total number of requests. If zero, one per target.
	N int

	// C is the number of concurrent workers. If zero, 1. It is capped at N.
	C int

	// HTTP2 offers HTTP/2 on TLS connections: to a TLS target directly, or
	// to the proxy's MITM inside a CONNECT tunnel. If false, only HTTP/1.1
	// is used.
	HTTP2 bool

	// Timeout bounds each request, including reading its body.
	// Zero means no limit other than ctx.
	Timeout time.Duration

	// Header is added to every request. A "Host" entry sets the request's
	// Host instead. Compression is not requested automatically, so the
	// proxy sees exactly these headers; add "Accept-Encoding: gzip" here to
	// exercise it.
	Header http.Header

	// Method is the request method. If empty, GET. Requests have no body.
	Method string

	// Repeat sends each target this many times in a row before moving on
	// to the next. If zero, 1 (plain round-robin). With C at least Repeat
	// the copies are in flight together: a stampede on every target, which
	// a deduplicating proxy answers with one upstream request each.
	Repeat int
}

// maxErrorSamples is how many distinct error messages a Result keeps.
const maxErrorSamples = 5

// Run sends o.N requests at concurrency o.C, spreading them round-robin over
// o.Targets, and reports what happened. Each worker reuses keep-alive
// connections from one shared transport; bodies are read fully and
// discarded. A failed request is counted in Result.Errors, not returned.
//
// Run returns an error only for invalid options, or when ctx is done
// before all requests were sent; in that case it still returns the Result
// of the requests that completed, after waiting for those in flight.
func Run(ctx context.Context, o Options) (*Result, error) {
	if len(o.Targets) == 0 {
		return nil, errors.New("run: no targets")
	}
	for _, t := range o.Targets {
		u, err := url.Parse(t)
		if err != nil {
			return nil, fmt.Errorf("run: target: %w", err)
		}
		if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return nil, fmt.Errorf("run: target %q: want an absolute http or https URL", t)
		}
	}
	if o.N < 0 || o.C < 0 || o.Timeout < 0 || o.Repeat < 0 {
		return nil, fmt.Errorf("run: negative N (%d), C (%d), Repeat (%d) or Timeout (%v)", o.N, o.C, o.Repeat, o.Timeout)
	}
	n := o.N
	if n == 0 {
		n = len(o.Targets)
	}
	c := min(max(o.C, 1), n)
	method := o.Method
	if method == "" {
		method = http.MethodGet
	}
	if _, err := http.NewRequest(method, o.Targets[0], nil); err != nil {
		return nil, fmt.Errorf("run: %w", err) // an invalid method
	}
	header := o.Header.Clone()
	if header == nil {
		header = make(http.Header) // Clone of a nil Header is nil; requests need one
	}
	host := header.Get("Host")
	header.Del("Host")

	roots, err := rootCAs(o.CAFile)
	if err != nil {
		return nil, fmt.Errorf("run: %w", err)
	}
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetHTTP2(o.HTTP2)
	tr := &http.Transport{
		Proxy: http.ProxyURL(o.Proxy), // nil URL: direct
		DialContext: (&net.Dialer{
			Timeout:   10 * time.Second,
			KeepAlive: 30 * time.Second,
		}).DialContext,
		TLSClientConfig:     &tls.Config{RootCAs: roots},
		Protocols:           &protocols,
		TLSHandshakeTimeout: 10 * time.Second,
		MaxIdleConnsPerHost: c,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
	defer tr.CloseIdleConnections()

	r := &runner{
		tr:      tr,
		targets: slices.Clone(o.Targets),
		repeat:  int64(max(o.Repeat, 1)),
		n:       int64(n),
		method:  method,
		header:  header,
		host:    host,
		timeout: o.Timeout,
	}
	workers := make([]worker, c)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range workers {
		w := &workers[i]
		w.init(n/c + 1)
		wg.Go(func() { r.work(ctx, w) })
	}
	wg.Wait()
	res := r.result(workers, time.Since(start))
	if err := ctx.Err(); err != nil && int64(res.Requests) < r.n {
		return res, fmt.Errorf("run: stopped after %d of %d requests: %w", res.Requests, n, err)
	}
	return res, nil
}

// rootCAs returns the system pool plus the certificates in caFile.
func rootCAs(caFile string) (*x509.CertPool, error) {
	pool, err := x509.SystemCertPool()
	if err != nil {
		pool = x509.NewCertPool() // no system pool: trust caFile alone
	}
	if caFile == "" {
		return pool, nil
	}
	pemBytes, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("read CA file: %w", err)
	}
	if !pool.AppendCertsFromPEM(pemBytes) {
		return nil, fmt.Errorf("read CA file %s: no PEM certificate found", caFile)
	}
	return pool, nil
}

// runner holds what the workers of one Run share.
type runner struct {
	tr      *http.Transport
	targets []string
	repeat  int64 // consecutive requests per target
	n       int64
	method  string
	header  http.Header // without Host
	host    string
	timeout time.Duration

	next atomic.Int64 // index of the next request to send

	mu      sync.Mutex // protects samples
	samples []string   // first distinct error messages
}

// worker accumulates the outcome of the requests one goroutine sent, so
// that the hot path shares nothing but runner.next: a Result of its own,
// its latencies in the order they came.
type worker struct {
	Result
}

func (w *worker) init(capacity int) {
	w.latencies = make([]time.Duration, 0, capacity)
	w.Status = make(map[int]int)
	w.XCache = make(map[string]int)
	w.Protos = make(map[string]int)
}

func (r *runner) work(ctx context.Context, w *worker) {
	for ctx.Err() == nil {
		i := r.next.Add(1) - 1
		if i >= r.n {
			return
		}
		r.do(ctx, w, r.targets[(i/r.repeat)%int64(len(r.targets))])
	}
}

// do sends one request and records its outcome in w.
func (r *runner) do(ctx context.Context, w *worker, target string) {
	rctx := ctx
	if r.timeout > 0 {
		var cancel context.CancelFunc
		rctx, cancel = context.WithTimeout(ctx, r.timeout)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(rctx, r.method, target, nil)
	if err != nil {
		r.fail(ctx, w, err)
		return
	}
	req.Header = r.header.Clone()
	if r.host != "" {
		req.Host = r.host
	}

	start := time.Now()
	resp, err := r.tr.RoundTrip(req)
	if err != nil {
		r.fail(ctx, w, err)
		return
	}
	nr, err := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	elapsed := time.Since(start)
	w.BytesRead += nr
	if err != nil {
		r.fail(ctx, w, fmt.Errorf("read body: %w", err))
		return
	}

	w.Requests++
	w.latencies = append(w.latencies, elapsed)
	w.Status[resp.StatusCode]++
	w.Protos[resp.Proto]++
	xc := resp.Header.Get("X-Cache")
	if xc == "" {
		xc = "-"
	}
	w.XCache[xc]++
}

// fail counts err against w, unless the run itself was cancelled: a request
// cut short by the caller is neither a success nor a failure.
func (r *runner) fail(ctx context.Context, w *worker, err error) {
	if ctx.Err() != nil {
		return
	}
	w.Requests++
	w.Errors++

	// Drop the URL from *url.Error so that the same failure on K targets
	// is one sample, not K.
	msg := err.Error()
	if ue, ok := errors.AsType[*url.Error](err); ok {
		msg = ue.Op + ": " + ue.Err.Error()
	}
	r.mu.Lock()
	r.samples = addSample(r.samples, msg)
	r.mu.Unlock()
}

// result merges the workers' tallies. They ran at once: the run's
// duration is elapsed, not their sum.
func (r *runner) result(workers []worker, elapsed time.Duration) *Result {
	parts := make([]*Result, len(workers))
	for i := range workers {
		parts[i] = &workers[i].Result
	}
	res := Merge(parts...)
	r.mu.Lock()
	res.ErrorSamples = append([]string(nil), r.samples...)
	r.mu.Unlock()
	res.Duration = elapsed // Merge summed the workers' none
	if elapsed > 0 {
		res.RPS = float64(res.Requests) / elapsed.Seconds()
	}
	return res
}
