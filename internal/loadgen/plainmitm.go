package loadgen

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/elazarl/goproxy"
)

// PlainMITMOptions configures [StartPlainMITM].
type PlainMITMOptions struct {
	// Addr is where it listens; "" is a free loopback port.
	Addr string
	// OriginCAFiles are PEM files trusted for origins, besides the system
	// pool (an Origin's CAFile).
	OriginCAFiles []string
	// HTTP2 answers HTTP/2 clients over HTTP/2 (goproxy's AllowHTTP2),
	// instead of over HTTP/1.1 as goproxy does by default.
	HTTP2 bool
}

// PlainMITM is the baseline onceproxy is measured against: a plain
// goproxy MITM, the library onceproxy's front door is built on, with
// nothing added (goproxy's ConnectMitm, an http.Transport keeping 512 idle
// connections per host, no cache, no dedup, no logs, no metrics). Its CA
// is generated in memory at start; clients trust it through CAFile.
type PlainMITM struct {
	srv    *http.Server
	ln     net.Listener
	caFile string
	done   chan struct{}
}

// StartPlainMITM starts the baseline proxy.
func StartPlainMITM(o PlainMITMOptions) (*PlainMITM, error) {
	// A throw-away self-signed CA, like the origin's certificate.
	c, _, err := newOriginCert()
	if err != nil {
		return nil, err
	}
	ca, caPEM := c.tls, c.certPEM
	roots, err := x509.SystemCertPool()
	if err != nil || roots == nil {
		roots = x509.NewCertPool()
	}
	for _, f := range o.OriginCAFiles {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("plain mitm: %w", err)
		}
		roots.AppendCertsFromPEM(b)
	}
	gp := goproxy.NewProxyHttpServer()
	gp.Logger = log.New(io.Discard, "", 0)
	gp.Tr = &http.Transport{
		Proxy:               nil,
		TLSClientConfig:     &tls.Config{RootCAs: roots},
		ForceAttemptHTTP2:   true,
		MaxIdleConns:        512 * 64,
		MaxIdleConnsPerHost: 512,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
	gp.ConnectDial = nil
	gp.AllowHTTP2 = o.HTTP2
	mitm := &goproxy.ConnectAction{Action: goproxy.ConnectMitm, TLSConfig: goproxy.TLSConfigFromCA(&ca)}
	gp.OnRequest().HandleConnectFunc(func(host string, _ *goproxy.ProxyCtx) (*goproxy.ConnectAction, string) {
		return mitm, host
	})
	addr := o.Addr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("plain mitm: %w", err)
	}
	caFile, err := writeTempCA(caPEM)
	if err != nil {
		ln.Close()
		return nil, err
	}
	p := &PlainMITM{srv: &http.Server{Handler: gp, ReadHeaderTimeout: 10 * time.Second}, ln: ln, caFile: caFile, done: make(chan struct{})}
	go func() {
		defer close(p.done)
		if err := p.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Printf("plain mitm: %v", err)
		}
	}()
	return p, nil
}

// Addr is the proxy's address (host:port).
func (p *PlainMITM) Addr() string { return p.ln.Addr().String() }

// CAFile is the PEM file of the CA its MITM certificates chain to.
func (p *PlainMITM) CAFile() string { return p.caFile }

// Close stops the proxy and removes its CA file.
func (p *PlainMITM) Close() {
	p.srv.Close()
	<-p.done
	os.Remove(p.caFile)
}
