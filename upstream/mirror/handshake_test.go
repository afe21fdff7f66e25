package mirror

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/fporigin"
)

// TestHandshakeTimeoutIsNotARefusal: an origin that accepts the
// connection and then says nothing has not refused the hello. The dial
// must fail once, after one HandshakeTimeout, as a timeout: not be redialed
// with the closest and the Go hello (three dials, three timeouts), and not
// leave a downgraded rung in the memo for an hour when a later rung happens
// to get through.
func TestHandshakeTimeoutIsNotARefusal(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				io.Copy(io.Discard, c) // a tarpit: reads the hello, never answers
				c.Close()
			}()
		}
	}()
	var cd countingDialer
	const timeout = 300 * time.Millisecond
	d := &Dialer{Dial: cd.dial, HandshakeTimeout: timeout, TLSConfig: &tls.Config{ServerName: "localhost"}}
	start := time.Now()
	_, err = d.DialTLS(ctxTimeout(t, 10*time.Second), "tcp", ln.Addr().String(), chromeHello(t))
	took := time.Since(start)
	if err == nil {
		t.Fatal("handshake with a silent origin succeeded")
	}
	if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("error %v is not a timeout", err)
	}
	if n := cd.n.Load(); n != 1 || took > 2*timeout {
		t.Errorf("%d dials in %v for one handshake timeout of %v (%v)", n, took, timeout, err)
	}
}

// TestRecordVersionMirrored: the record-layer version of the hello's
// record (0x0303 for Java's JSSE and others, 0x0301 for most) is the
// client's.
func TestRecordVersionMirrored(t *testing.T) {
	o := startOrigin(t, fporigin.Options{})
	g := goHello(t, "http/1.1")
	raw := append([]byte(nil), g.Raw...)
	raw[2] = 3 // record version 0x0303
	hello, err := fingerprint.ParseClientHello(raw)
	if err != nil {
		t.Fatal(err)
	}
	cc, c := openConn(t, o, hello, nil, Options{})
	if r := c.Report(); r.Mode != Mirrored {
		t.Errorf("report %+v", r)
	}
	getRoot(t, cc, o)
	got := o.Records()[0].Hello
	if got.RecordVersion != hello.RecordVersion {
		t.Errorf("hello record version at the origin %#04x, client's %#04x", got.RecordVersion, hello.RecordVersion)
	}
	if got.JA4() != hello.JA4() {
		t.Errorf("JA4 %s, client's %s", got.JA4(), hello.JA4())
	}
}

// TestCutHandshakeIsRetriedBeforeADowngrade: an origin whose first
// handshake is reset (a restart, a balancer shedding load) gets the
// client's own hello once more, and the connection is mirrored: not the
// next rung's hello, which the memo would then keep for an hour.
func TestCutHandshakeIsRetriedBeforeADowngrade(t *testing.T) {
	o := startOrigin(t, fporigin.Options{})
	resetter, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { resetter.Close(); wg.Wait() })
	wg.Go(func() {
		c, err := resetter.Accept()
		if err != nil {
			return
		}
		c.Read(make([]byte, 1)) // the hello has come
		c.(*net.TCPConn).SetLinger(0)
		c.Close()
	})
	var n atomic.Int32
	d := newDialer(o, nil)
	d.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if n.Add(1) == 1 {
			addr = resetter.Addr().String()
		}
		var nd net.Dialer
		return nd.DialContext(ctx, network, addr)
	}
	c, err := d.DialTLS(ctxTimeout(t, 10*time.Second), "tcp", o.Addr(), chromeHello(t))
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if r := c.Report(); r.Mode != Mirrored || len(r.Failed) != 0 || n.Load() != 2 {
		t.Errorf("report %+v after %d dials, want the mirrored hello on the second", r, n.Load())
	}
}
