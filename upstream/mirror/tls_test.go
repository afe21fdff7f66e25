package mirror

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint/fporigin"
)

// TestDialTLSMirrorsHello: the origin receives the client's hello: same
// JA4, same extensions in the same order (GREASE positions kept), same
// identity, same length.
func TestDialTLSMirrorsHello(t *testing.T) {
	o := startOrigin(t, fporigin.Options{})
	for name, hello := range map[string]*fingerprint.ClientHello{
		"go h2":      goHello(t, "h2", "http/1.1"),
		"go no alpn": goHello(t),
		"chrome 133": chromeHello(t),
		"firefox":    firefoxHello(t),
	} {
		t.Run(name, func(t *testing.T) {
			o.Reset()
			cc, c := openConn(t, o, hello, nil, Options{})
			if r := c.Report(); r.Mode != Mirrored {
				t.Errorf("report %+v", r)
			}
			getRoot(t, cc, o)
			recs := o.Records()
			if len(recs) != 1 {
				t.Fatalf("%d records", len(recs))
			}
			got := recs[0].Hello
			if recs[0].JA4 != hello.JA4() {
				t.Errorf("JA4 at the origin %s, client %s", recs[0].JA4, hello.JA4())
			}
			if !slices.Equal(extTypes(got), extTypes(hello)) {
				t.Errorf("extensions at the origin %x\nclient's %x", extTypes(got), extTypes(hello))
			}
			if fingerprint.New(got, nil).ID() != fingerprint.New(hello, nil).ID() {
				t.Errorf("identity differs: %s vs %s", got.JA4R(), hello.JA4R())
			}
			if len(got.Raw) != len(hello.Raw) {
				t.Errorf("hello of %d bytes at the origin, client's %d", len(got.Raw), len(hello.Raw))
			}
			if !slices.Equal(got.ALPN, hello.ALPN) || !slices.Equal(got.SignatureAlgorithms, hello.SignatureAlgorithms) {
				t.Errorf("ALPN %q sigalgs %x; client's %q %x", got.ALPN, got.SignatureAlgorithms, hello.ALPN, hello.SignatureAlgorithms)
			}
			wantProto := "HTTP/1.1"
			if len(hello.ALPN) > 0 && hello.ALPN[0] == "h2" {
				wantProto = "HTTP/2.0"
			}
			if recs[0].Proto != wantProto {
				t.Errorf("proto %s, want %s", recs[0].Proto, wantProto)
			}
		})
	}
}

// TestDialTLSDropsPSK: a hello carrying a session ticket of the proxy's
// (pre_shared_key, early_data) goes out without them.
func TestDialTLSDropsPSK(t *testing.T) {
	o := startOrigin(t, fporigin.Options{})
	h := goHello(t, "http/1.1")
	exts := slices.Clone(h.Extensions)
	exts = append(exts, fingerprint.Extension{Type: fingerprint.ExtEarlyData})
	// A syntactically valid PSK: one identity, one 32-byte binder.
	psk := []byte{0, 10, 0, 4, 't', 'k', 't', '!', 0, 0, 0, 1}
	psk = append(psk, 0, 33, 32)
	psk = append(psk, make([]byte, 32)...)
	exts = append(exts, fingerprint.Extension{Type: fingerprint.ExtPreSharedKey, Data: psk})
	hello := rebuild(t, h, exts)
	_, c := openConn(t, o, hello, nil, Options{})
	if r := c.Report(); r.Mode != Mirrored || len(r.Changes) != 2 {
		t.Errorf("report %+v", r)
	}
}

// TestClosestUnsupportedGroup: a key share utls cannot compute
// (ffdhe2048) is left out before dialing; the group stays offered and JA4
// is unchanged.
func TestClosestUnsupportedGroup(t *testing.T) {
	o := startOrigin(t, fporigin.Options{})
	h := goHello(t, "h2")
	var exts []fingerprint.Extension
	for _, x := range h.Extensions {
		switch x.Type {
		case fingerprint.ExtKeyShare:
			entry := binary.BigEndian.AppendUint16(nil, 0x0100)
			entry = binary.BigEndian.AppendUint16(entry, 256)
			entry = append(entry, make([]byte, 256)...)
			list := append(entry, x.Data[2:]...)
			x.Data = append(binary.BigEndian.AppendUint16(nil, uint16(len(list))), list...)
		case fingerprint.ExtSupportedGroups:
			list := append(slices.Clone(x.Data[2:]), 0x01, 0x00)
			x.Data = append(binary.BigEndian.AppendUint16(nil, uint16(len(list))), list...)
		}
		exts = append(exts, x)
	}
	hello := rebuild(t, h, exts)
	if !slices.Contains(hello.KeyShareGroups, 0x0100) {
		t.Fatal("crafted hello lacks the ffdhe2048 share")
	}
	cc, c := openConn(t, o, hello, nil, Options{})
	r := c.Report()
	if r.Mode != Closest || !strings.Contains(strings.Join(r.Changes, ";"), "0x0100") || len(r.Failed) != 0 {
		t.Errorf("report %+v", r)
	}
	getRoot(t, cc, o)
	got := o.Records()[0].Hello
	if got.JA4() != hello.JA4() || slices.Contains(got.KeyShareGroups, 0x0100) || !slices.Contains(got.SupportedGroups, 0x0100) {
		t.Errorf("origin saw JA4 %s (client %s), shares %x, groups %x", got.JA4(), hello.JA4(), got.KeyShareGroups, got.SupportedGroups)
	}
}

// TestClosestAfterRefusal: an unknown extension goes out verbatim; an
// origin that refuses it gets the closest hello on a second connection,
// and the next dial starts there.
func TestClosestAfterRefusal(t *testing.T) {
	var refused atomic.Int32
	o := startOrigin(t, fporigin.Options{Refuse: func(h *fingerprint.ClientHello) error {
		if _, ok := h.Extension(0x7777); ok {
			refused.Add(1)
			return errors.New("unknown extension")
		}
		return nil
	}})
	h := goHello(t, "http/1.1")
	hello := rebuild(t, h, append(slices.Clone(h.Extensions), fingerprint.Extension{Type: 0x7777, Data: []byte("abc")}))

	var cd countingDialer
	d := newDialer(o, &cd)
	c, err := d.DialTLS(ctxTimeout(t, 10*time.Second), "tcp", o.Addr(), hello)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	r := c.Report()
	if r.Mode != Closest || len(r.Failed) != 1 || cd.n.Load() != 2 || refused.Load() != 1 {
		t.Errorf("report %+v after %d dials, %d refusals", r, cd.n.Load(), refused.Load())
	}
	// Remembered: one dial now.
	c, err = d.DialTLS(ctxTimeout(t, 10*time.Second), "tcp", o.Addr(), hello)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if c.Report().Mode != Closest || cd.n.Load() != 3 || refused.Load() != 1 {
		t.Errorf("second dial: report %+v, %d dials, %d refusals", c.Report(), cd.n.Load(), refused.Load())
	}

	// Without the refusal the same hello is mirrored, the extension
	// verbatim.
	o2 := startOrigin(t, fporigin.Options{})
	c, err = newDialer(o2, &cd).DialTLS(ctxTimeout(t, 10*time.Second), "tcp", o2.Addr(), hello)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if r := c.Report(); r.Mode != Mirrored || !slices.Equal(r.Verbatim, []uint16{0x7777}) {
		t.Errorf("report %+v", r)
	}
}

// TestGoFallback: when the origin refuses the mirrored and the closest
// hello, the Go hello still gets the request through; a nil hello goes
// straight to it.
func TestGoFallback(t *testing.T) {
	o := startOrigin(t, fporigin.Options{Refuse: func(h *fingerprint.ClientHello) error {
		if slices.ContainsFunc(h.CipherSuites, fingerprint.IsGREASE) {
			return errors.New("no GREASE here")
		}
		return nil
	}})
	var cd countingDialer
	c, err := newDialer(o, &cd).DialTLS(ctxTimeout(t, 10*time.Second), "tcp", o.Addr(), chromeHello(t))
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if r := c.Report(); r.Mode != Go || len(r.Failed) != 2 || cd.n.Load() != 3 {
		t.Errorf("report %+v after %d dials", r, cd.n.Load())
	}
	if p := c.ConnectionState().NegotiatedProtocol; p != "h2" {
		t.Errorf("the Go hello lost the client's ALPN: %q", p)
	}
	d := newDialer(o, &cd)
	d.TLSConfig.NextProtos = []string{"h2", "http/1.1"} // what the client spoke, its hello lost
	c, err = d.DialTLS(ctxTimeout(t, 10*time.Second), "tcp", o.Addr(), nil)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if c.Report().Mode != Go || c.ConnectionState().NegotiatedProtocol != "h2" {
		t.Errorf("nil hello: %+v, ALPN %q", c.Report(), c.ConnectionState().NegotiatedProtocol)
	}
}

// TestNoRetryOnVerifyFailure: an origin whose certificate does not verify
// is not redialed with other hellos.
func TestNoRetryOnVerifyFailure(t *testing.T) {
	o := startOrigin(t, fporigin.Options{})
	var cd countingDialer
	for name, cfg := range map[string]*tls.Config{
		"unknown CA": {RootCAs: x509.NewCertPool(), ServerName: "localhost"},
		"callback": {RootCAs: o.CertPool(), ServerName: "localhost",
			VerifyConnection: func(tls.ConnectionState) error { return errors.New("pinned elsewhere") }},
	} {
		before := cd.n.Load()
		d := &Dialer{Dial: cd.dial, TLSConfig: cfg}
		_, err := d.DialTLS(ctxTimeout(t, 10*time.Second), "tcp", o.Addr(), goHello(t, "h2"))
		if err == nil {
			t.Fatalf("%s: verified", name)
		}
		if n := cd.n.Load() - before; n != 1 {
			t.Errorf("%s: %d dials (%v)", name, n, err)
		}
	}
}

// curlTLS12Hello is the hello of curl 7.88.1 with OpenSSL 3.0 and
// --tls-max 1.2 for https://localhost, captured at a loopback listener.
// Without TLS 1.3 OpenSSL has no middlebox-compatibility session id to
// send: legacy_session_id is empty.
const curlTLS12Hello = "16030100d7010000d303035e069ec4d714d4c2e0f3b05ea0b286058f06c5094ca3d5d3b3483adb5700cc55000038c02cc030009fcca9cca8ccaac02bc02f009ec024c028006bc023c0270067c00ac0140039c009c0130033009d009c003d003c0035002f00ff010000720000000e000c0000096c6f63616c686f7374000b000403000102000a000c000a001d0017001e001900180010000e000c02683208687474702f312e310016000000170000000d002a0028040305030603080708080809080a080b080408050806040105010601030303010302040205020602"

// TestDialTLSMirrorsSessionIDLength: the origin sees a session id as long
// as the client's (fresh bytes): none from a TLS-1.2-only OpenSSL client,
// 32 bytes from Go's. utls always makes up 32 bytes, which tells the
// origin, by the hello's length alone, that curl's hello was not curl's.
func TestDialTLSMirrorsSessionIDLength(t *testing.T) {
	raw, err := hex.DecodeString(curlTLS12Hello)
	if err != nil {
		t.Fatal(err)
	}
	curl, err := fingerprint.ParseClientHello(raw)
	if err != nil {
		t.Fatal(err)
	}
	o := startOrigin(t, fporigin.Options{})
	for name, hello := range map[string]*fingerprint.ClientHello{
		"curl tls1.2": curl,
		"go":          goHello(t, "h2", "http/1.1"),
	} {
		t.Run(name, func(t *testing.T) {
			o.Reset()
			cc, c := openConn(t, o, hello, nil, Options{})
			if r := c.Report(); r.Mode != Mirrored {
				t.Errorf("report %+v", r)
			}
			getRoot(t, cc, o)
			got := o.Records()[0].Hello
			if len(got.SessionID) != len(hello.SessionID) || len(got.Raw) != len(hello.Raw) {
				t.Errorf("origin saw a %d-byte session id in a %d-byte hello; the client sent %d in %d",
					len(got.SessionID), len(got.Raw), len(hello.SessionID), len(hello.Raw))
			}
			if len(got.SessionID) > 0 && bytes.Equal(got.SessionID, hello.SessionID) {
				t.Error("the client's session id went out as it was, not fresh")
			}
			if got.JA4() != hello.JA4() || got.JA3() != hello.JA3() {
				t.Errorf("JA4 %s JA3 %s; client's %s %s", got.JA4(), got.JA3(), hello.JA4(), hello.JA3())
			}
		})
	}
}
