package loadgen

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// startOrigin starts an origin that is closed when the test ends.
func startOrigin(t *testing.T, opts OriginOptions) *Origin {
	t.Helper()
	o, err := StartOrigin(opts)
	if err != nil {
		t.Fatalf("StartOrigin(): got %v, want no error", err)
	}
	t.Cleanup(o.Close)
	return o
}

// get fetches url with a fresh direct transport and returns the response
// with its body read.
func get(t *testing.T, url string) (*http.Response, []byte) {
	t.Helper()
	tr := &http.Transport{} // no Proxy: never the environment's
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr}).Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: read body: %v", url, err)
	}
	return resp, body
}

func TestOriginBody(t *testing.T) {
	const size = 300
	a := OriginBody("/item/1?q=1", size)
	if g, e := len(a), size; g != e {
		t.Fatalf("len(OriginBody()) = %d, want %d", g, e)
	}
	if !bytes.Equal(a, OriginBody("/item/1?q=1", size)) {
		t.Errorf("OriginBody() differs between calls with the same URI")
	}
	for _, other := range []string{"/item/2?q=2", "/item/1?q=2", "/item/1"} {
		if bytes.Equal(a, OriginBody(other, size)) {
			t.Errorf("OriginBody(%q) = OriginBody(%q), want different bodies", other, "/item/1?q=1")
		}
	}
	// Only the prefix is the URI; the rest must differ too, so that a
	// truncated comparison still tells keys apart.
	if bytes.Equal(a[100:], OriginBody("/item/2?q=2", size)[100:]) {
		t.Errorf("OriginBody() tails are equal for different URIs")
	}
	if g := OriginBody("/x", 0); len(g) != 0 {
		t.Errorf("OriginBody(size 0) = %q, want empty", g)
	}
}

func TestOriginServesBodyAndCounts(t *testing.T) {
	const size = 1000
	o := startOrigin(t, OriginOptions{BodySize: size})

	for i, uri := range []string{"/item/3?q=3", "/item/3?q=3", "/other"} {
		resp, body := get(t, o.URL()+uri)
		if g, e := resp.StatusCode, http.StatusOK; g != e {
			t.Fatalf("GET %s: status %d, want %d", uri, g, e)
		}
		if !bytes.Equal(body, OriginBody(uri, size)) {
			t.Errorf("GET %s: body is not OriginBody(%q, %d)", uri, uri, size)
		}
		if g, e := resp.Header.Get("X-Origin-Request"), strconv.Itoa(i+1); g != e {
			t.Errorf("GET %s: X-Origin-Request = %q, want %q", uri, g, e)
		}
	}
	if g, e := o.Requests(), int64(3); g != e {
		t.Errorf("Requests() = %d, want %d", g, e)
	}
	if g, e := o.RequestsFor("/item/3"), int64(2); g != e {
		t.Errorf("RequestsFor(/item/3) = %d, want %d", g, e)
	}
	if g := o.RequestsFor("/never"); g != 0 {
		t.Errorf("RequestsFor(/never) = %d, want 0", g)
	}
	if g := o.CAFile(); g != "" {
		t.Errorf("CAFile() of a plain HTTP origin = %q, want empty", g)
	}
}

func TestOriginCertDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "certs") // created by StartOrigin
	o1 := startOrigin(t, OriginOptions{TLS: true, CertDir: dir})
	if g, e := o1.CAFile(), filepath.Join(dir, "origin.pem"); g != e {
		t.Fatalf("CAFile() = %q, want %q", g, e)
	}
	fi, err := os.Stat(filepath.Join(dir, "origin-key.pem"))
	if err != nil {
		t.Fatal(err)
	}
	if g, e := fi.Mode().Perm(), fs.FileMode(0o600); g != e {
		t.Errorf("key file mode = %v, want %v", g, e)
	}
	first, err := os.ReadFile(o1.CAFile())
	if err != nil {
		t.Fatal(err)
	}
	o1.Close()

	o2 := startOrigin(t, OriginOptions{TLS: true, CertDir: dir})
	second, err := os.ReadFile(o2.CAFile())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(first, second) {
		t.Errorf("second StartOrigin with the same CertDir rewrote the certificate")
	}

	block, _ := pem.Decode(second)
	if block == nil {
		t.Fatalf("%s: no PEM block", o2.CAFile())
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	if pub, ok := cert.PublicKey.(*ecdsa.PublicKey); !ok || pub.Curve != elliptic.P256() {
		t.Errorf("certificate key = %T, want ECDSA P-256", cert.PublicKey)
	}
	for _, host := range []string{"127.0.0.1", "::1", "localhost"} {
		if err := cert.VerifyHostname(host); err != nil {
			t.Errorf("certificate not valid for %s: %v", host, err)
		}
	}

	// A second origin on the same CertDir is trusted through the file the
	// first one wrote, as a proxy started earlier would trust it.
	res, err := Run(context.Background(), Options{
		CAFile:  filepath.Join(dir, "origin.pem"),
		Targets: []string{o2.URL() + "/a"},
	})
	if err != nil {
		t.Fatalf("Run(): %v", err)
	}
	if res.Errors != 0 {
		t.Errorf("Run() errors = %d (%q), want 0", res.Errors, res.ErrorSamples)
	}
}

func TestOriginCertDirUnreadable(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"origin.pem", "origin-key.pem"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("not PEM"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if o, err := StartOrigin(OriginOptions{TLS: true, CertDir: dir}); err == nil {
		o.Close()
		t.Fatalf("StartOrigin() with garbage cert files: got no error")
	}
	got, err := os.ReadFile(filepath.Join(dir, "origin.pem"))
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != "not PEM" {
		t.Errorf("StartOrigin() overwrote an unreadable cert file")
	}
}

func TestOriginTempCAFileRemovedOnClose(t *testing.T) {
	o, err := StartOrigin(OriginOptions{TLS: true})
	if err != nil {
		t.Fatal(err)
	}
	ca := o.CAFile()
	if _, err := os.Stat(ca); err != nil {
		o.Close()
		t.Fatalf("CAFile() %q: %v", ca, err)
	}
	o.Close()
	o.Close() // idempotent
	if _, err := os.Stat(ca); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("after Close, stat %s: got %v, want not exist", ca, err)
	}
}

// TestOriginCloseAbortsLatencyWait checks that Close does not wait out the
// Latency of a request in flight, and that the client sees a failure rather
// than an empty 200.
func TestOriginCloseAbortsLatencyWait(t *testing.T) {
	arrived := make(chan string, 1)
	o := startOrigin(t, OriginOptions{Latency: time.Hour, arrived: arrived})

	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	errc := make(chan error, 1)
	go func() {
		resp, err := (&http.Client{Transport: tr}).Get(o.URL() + "/slow")
		if err == nil {
			resp.Body.Close()
			err = errors.New("got a response")
		}
		errc <- err
	}()
	if g, e := <-arrived, "/slow"; g != e {
		t.Fatalf("arrived %q, want %q", g, e)
	}
	o.Close() // must return although the handler would wait an hour
	if err := <-errc; err == nil || err.Error() == "got a response" {
		t.Errorf("client during Close: got %v, want a transport error", err)
	}
	if g, e := o.Requests(), int64(1); g != e {
		t.Errorf("Requests() = %d, want %d", g, e)
	}
}

func TestOriginRejectsBadOptions(t *testing.T) {
	for _, opts := range []OriginOptions{
		{BodySize: -1},
		{Latency: -time.Second},
		{Addr: "256.0.0.1:0"},
	} {
		if o, err := StartOrigin(opts); err == nil {
			o.Close()
			t.Errorf("StartOrigin(%+v): got no error", opts)
		}
	}
}

func TestOriginHTTP2(t *testing.T) {
	o := startOrigin(t, OriginOptions{TLS: true})
	for _, h2 := range []bool{false, true} {
		res, err := Run(context.Background(), Options{
			CAFile:  o.CAFile(),
			Targets: []string{o.URL() + "/p"},
			N:       4,
			C:       2,
			HTTP2:   h2,
		})
		if err != nil {
			t.Fatalf("Run(HTTP2=%v): %v", h2, err)
		}
		want := "HTTP/1.1"
		if h2 {
			want = "HTTP/2.0"
		}
		if res.Protos[want] != 4 || len(res.Protos) != 1 {
			t.Errorf("Run(HTTP2=%v) protocols = %v, want only %s", h2, res.Protos, want)
		}
	}
}
