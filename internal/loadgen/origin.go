package loadgen

import (
	"crypto/tls"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// OriginOptions configures [StartOrigin]. The zero value is a plain HTTP
// origin on a free loopback port that answers at once with an empty body.
type OriginOptions struct {
	// Addr is the TCP address to listen on.
	// If empty, "127.0.0.1:0" (a free loopback port) is used.
	Addr string

	// TLS makes the origin serve HTTPS, offering HTTP/2 and HTTP/1.1.
	TLS bool

	// Latency delays every response. The wait ends early, without a
	// response, when the request's context is cancelled or the origin is
	// closed.
	Latency time.Duration

	// BodySize is the length in bytes of every response body; see
	// [OriginBody]. Zero means an empty body.
	BodySize int

	// CertDir is where the TLS certificate lives when TLS is set.
	// origin.pem and origin-key.pem are reused if present and created
	// (the key with mode 0600) if not, so that a proxy started earlier can
	// keep trusting the same file across runs. If empty, a certificate is
	// generated in memory and written to a temporary file for [Origin.CAFile].
	CertDir string

	// ErrorLog receives server errors such as failed TLS handshakes.
	// If nil, they are discarded.
	ErrorLog *log.Logger

	// arrived, if non-nil, receives the path of every request as soon as it
	// is counted, before the Latency wait. Tests use it to synchronise with
	// in-flight requests.
	arrived chan<- string
}

// An Origin is a loopback HTTP(S) server that answers every request with a
// body derived from its URI and counts the requests that reach it.
// Create one with [StartOrigin] and stop it with [Origin.Close].
type Origin struct {
	url       string
	caFile    string // "" when not TLS
	removeCA  bool   // caFile is a temporary file owned by the Origin
	latency   time.Duration
	bodySize  int
	arrived   chan<- string
	srv       *http.Server
	serveDone chan struct{} // closed when Serve has returned

	total   atomic.Int64
	perPath sync.Map // request path (string) → *atomic.Int64

	done      chan struct{} // closed by Close; ends Latency waits
	closeOnce sync.Once

	mu       sync.Mutex // protects closed, and orders handlers.Add before handlers.Wait
	closed   bool
	handlers sync.WaitGroup
}

// StartOrigin listens on opts.Addr and serves until [Origin.Close].
func StartOrigin(opts OriginOptions) (*Origin, error) {
	if opts.BodySize < 0 {
		return nil, fmt.Errorf("start origin: negative body size %d", opts.BodySize)
	}
	if opts.Latency < 0 {
		return nil, fmt.Errorf("start origin: negative latency %v", opts.Latency)
	}
	addr := opts.Addr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	errorLog := opts.ErrorLog
	if errorLog == nil {
		errorLog = log.New(io.Discard, "", 0)
	}

	o := &Origin{
		latency:   opts.Latency,
		bodySize:  opts.BodySize,
		arrived:   opts.arrived,
		serveDone: make(chan struct{}),
		done:      make(chan struct{}),
	}

	var protocols http.Protocols
	protocols.SetHTTP1(true)
	var tlsConf *tls.Config
	if opts.TLS {
		var (
			c   *originCert
			err error
		)
		if opts.CertDir != "" {
			if c, err = loadOrCreateCert(opts.CertDir); err != nil {
				return nil, fmt.Errorf("start origin: %w", err)
			}
			o.caFile = filepath.Join(opts.CertDir, originCertFile)
		} else {
			if c, _, err = newOriginCert(); err != nil {
				return nil, fmt.Errorf("start origin: %w", err)
			}
			if o.caFile, err = writeTempCA(c.certPEM); err != nil {
				return nil, fmt.Errorf("start origin: %w", err)
			}
			o.removeCA = true
		}
		tlsConf = &tls.Config{
			Certificates: []tls.Certificate{c.tls},
			MinVersion:   tls.VersionTLS12,
		}
		protocols.SetHTTP2(true)
	}

	ln, err := net.Listen("tcp", addr)
	if err != nil {
		if o.removeCA {
			os.Remove(o.caFile)
		}
		return nil, fmt.Errorf("start origin: listen: %w", err)
	}
	scheme := "http"
	if opts.TLS {
		scheme = "https"
	}
	o.url = scheme + "://" + ln.Addr().String()

	o.srv = &http.Server{
		Handler:           http.HandlerFunc(o.serveHTTP),
		TLSConfig:         tlsConf,
		Protocols:         &protocols,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          errorLog,
	}
	go func() {
		defer close(o.serveDone)
		var err error
		if opts.TLS {
			err = o.srv.ServeTLS(ln, "", "") // certificate comes from TLSConfig
		} else {
			err = o.srv.Serve(ln)
		}
		if err != nil && !errors.Is(err, http.ErrServerClosed) {
			errorLog.Printf("onceload origin: serve: %v", err)
		}
	}()
	return o, nil
}

// writeTempCA writes certPEM to a new temporary file and returns its path.
func writeTempCA(certPEM []byte) (string, error) {
	f, err := os.CreateTemp("", "onceload-origin-*.pem")
	if err != nil {
		return "", fmt.Errorf("write origin CA file: %w", err)
	}
	if _, err := f.Write(certPEM); err != nil {
		f.Close()
		os.Remove(f.Name())
		return "", fmt.Errorf("write origin CA file: %w", err)
	}
	if err := f.Close(); err != nil {
		os.Remove(f.Name())
		return "", fmt.Errorf("write origin CA file: %w", err)
	}
	return f.Name(), nil
}

// URL returns the origin's base URL, such as "https://127.0.0.1:40123",
// without a trailing slash.
func (o *Origin) URL() string { return o.url }

// CAFile returns the path of the PEM certificate a client or proxy must
// trust to reach a TLS origin, or "" if the origin serves plain HTTP.
// Without OriginOptions.CertDir the file is temporary and is removed by
// [Origin.Close].
func (o *Origin) CAFile() string { return o.caFile }

// Requests reports how many requests have reached the origin, including
// those abandoned during the Latency wait.
func (o *Origin) Requests() int64 { return o.total.Load() }

// RequestsFor reports how many requests for path (without the query) have
// reached the origin.
func (o *Origin) RequestsFor(path string) int64 {
	if c, ok := o.perPath.Load(path); ok {
		return c.(*atomic.Int64).Load()
	}
	return 0
}

// Close stops the origin: it closes the listener and every connection,
// ends pending Latency waits and returns once the server goroutine and all
// handlers have finished. Close is idempotent.
func (o *Origin) Close() {
	o.closeOnce.Do(func() {
		o.mu.Lock()
		o.closed = true
		o.mu.Unlock()
		close(o.done)
		o.srv.Close()
		<-o.serveDone
		o.handlers.Wait()
		if o.removeCA {
			os.Remove(o.caFile)
		}
	})
}

// enter registers a running handler. It reports false once Close has begun,
// so that handlers.Add never races with handlers.Wait.
func (o *Origin) enter() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		return false
	}
	o.handlers.Add(1)
	return true
}

func (o *Origin) pathCounter(path string) *atomic.Int64 {
	if c, ok := o.perPath.Load(path); ok {
		return c.(*atomic.Int64)
	}
	c, _ := o.perPath.LoadOrStore(path, new(atomic.Int64))
	return c.(*atomic.Int64)
}

func (o *Origin) serveHTTP(w http.ResponseWriter, r *http.Request) {
	if !o.enter() {
		http.Error(w, "origin closing", http.StatusServiceUnavailable)
		return
	}
	defer o.handlers.Done()

	n := o.total.Add(1)
	o.pathCounter(r.URL.Path).Add(1)
	if o.arrived != nil {
		select {
		case o.arrived <- r.URL.Path:
		case <-r.Context().Done():
		case <-o.done:
		}
	}
	if o.latency > 0 {
		// An interrupted wait aborts the response: returning would send an
		// empty 200 that a client could mistake for a real answer.
		t := time.NewTimer(o.latency)
		defer t.Stop()
		select {
		case <-t.C:
		case <-r.Context().Done():
			panic(http.ErrAbortHandler)
		case <-o.done:
			panic(http.ErrAbortHandler)
		}
	}

	body := OriginBody(r.URL.RequestURI(), o.bodySize)
	h := w.Header()
	h.Set("Content-Type", "text/plain; charset=utf-8")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	// X-Origin-Request numbers the requests the origin has seen, so a
	// client can tell which upstream fetch a (possibly shared) response
	// came from.
	h.Set("X-Origin-Request", strconv.FormatInt(n, 10))
	w.Write(body) // an error means the client went away; nothing to do
}

// OriginBody returns the body an [Origin] with the given BodySize sends for
// requestURI (the path and query, as in [net/url.URL.RequestURI]). It is
// deterministic: identical URIs give identical bodies and different URIs
// different ones, so a caller can check that a proxy served the right body
// for each key. The body starts with the URI itself and continues with
// pseudo-random hex digits seeded by an FNV-1a hash of the URI.
func OriginBody(requestURI string, size int) []byte {
	if size <= 0 {
		return []byte{}
	}
	b := make([]byte, size)
	n := copy(b, "onceload "+requestURI+"\n")

	h := fnv.New64a()
	io.WriteString(h, requestURI)
	x := h.Sum64() | 1 // xorshift state must be non-zero
	const digits = "0123456789abcdef"
	for i := n; i < size; i++ {
		if i%65 == 64 {
			b[i] = '\n'
			continue
		}
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		b[i] = digits[x&0xf]
	}
	return b
}
