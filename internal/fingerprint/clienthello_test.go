package fingerprint

import (
	"bytes"
	"reflect"
	"testing"
)

const chromeSigAlgs = "0403,0804,0401,0503,0805,0501,0806,0601"

// chrome143 is the hello browserleaks.com recorded from Chrome 143 on
// Android, rebuilt from its ja4_ro (original order) with Chrome's GREASE
// placement. Its published fingerprints are the expected values below.
func chrome143(t testing.TB) helloSpec {
	return helloSpec{
		ciphers: append([]uint16{0x2a2a}, hexList(t, "1301,1302,1303,c02b,c02f,c02c,c030,cca9,cca8,c013,c014,009c,009d,002f,0035")...),
		exts: append(append([]uint16{0x1a1a},
			hexList(t, "002d,0033,0010,fe0d,0017,44cd,0000,000b,000a,002b,ff01,0023,0012,0005,000d,001b")...), 0x3a3a),
		sni:        "tls.browserleaks.com",
		alpn:       []string{"h2", "http/1.1"},
		versions:   []uint16{0x4a4a, 0x0304, 0x0303},
		sigAlgs:    hexList(t, chromeSigAlgs),
		groups:     []uint16{0x5a5a, 4588, 29, 23, 24},
		points:     []uint8{0},
		keyShares:  []uint16{0x5a5a, 4588, 29},
		sessionLen: 32,
	}
}

func TestJA4KnownHellos(t *testing.T) {
	for _, tc := range []struct {
		name             string
		spec             helloSpec
		ja4, ja4r        string
		ja3, ja3hash     string
		wantSNI, wantFst string
	}{
		{
			name: "browserleaks chrome 143",
			spec: chrome143(t),
			ja4:  "t13d1516h2_8daaf6152771_d8a2da3f94cd",
			ja4r: "t13d1516h2_002f,0035,009c,009d,1301,1302,1303,c013,c014,c02b,c02c,c02f,c030,cca8,cca9_0005,000a,000b,000d,0012,0017,001b,0023,002b,002d,0033,44cd,fe0d,ff01_0403,0804,0401,0503,0805,0501,0806,0601",
			ja3:  "771,4865-4866-4867-49195-49199-49196-49200-52393-52392-49171-49172-156-157-47-53,45-51-16-65037-23-17613-0-11-10-43-65281-35-18-5-13-27,4588-29-23-24,0",
			// JA3's hash as browserleaks published it.
			ja3hash: "98487aa16281980e7d1120d399efb6a4",
		},
		{
			// FoxIO's worked example in JA4.md.
			name: "JA4.md example",
			spec: helloSpec{
				ciphers:  hexList(t, "1301,1302,1303,c02b,c02f,c02c,c030,cca9,cca8,c013,c014,009c,009d,002f,0035"),
				exts:     hexList(t, "001b,0000,0033,0010,4469,0017,002d,000d,0005,0023,0012,002b,ff01,000b,000a,0015"),
				sni:      "example.com",
				alpn:     []string{"h2", "http/1.1"},
				versions: []uint16{0x0304, 0x0303},
				sigAlgs:  hexList(t, chromeSigAlgs),
			},
			ja4:  "t13d1516h2_8daaf6152771_e5627efa2ab1",
			ja4r: "t13d1516h2_002f,0035,009c,009d,1301,1302,1303,c013,c014,c02b,c02c,c02f,c030,cca8,cca9_0005,000a,000b,000d,0012,0015,0017,001b,0023,002b,002d,0033,4469,ff01_0403,0804,0401,0503,0805,0501,0806,0601",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, err := ParseClientHello(tc.spec.build())
			if err != nil {
				t.Fatal(err)
			}
			if got := h.JA4(); got != tc.ja4 {
				t.Errorf("JA4 = %s, want %s", got, tc.ja4)
			}
			if got := h.JA4R(); got != tc.ja4r {
				t.Errorf("JA4_r = %s\nwant %s", got, tc.ja4r)
			}
			if tc.ja3 != "" {
				if got := h.JA3(); got != tc.ja3 {
					t.Errorf("JA3 = %s\nwant %s", got, tc.ja3)
				}
				if got := h.JA3Hash(); got != tc.ja3hash {
					t.Errorf("JA3 hash = %s, want %s", got, tc.ja3hash)
				}
			}
			if h.ServerName != tc.spec.sni || !reflect.DeepEqual(h.ALPN, tc.spec.alpn) {
				t.Errorf("SNI %q ALPN %q", h.ServerName, h.ALPN)
			}
		})
	}
}

func TestJA4Edges(t *testing.T) {
	base := helloSpec{ciphers: []uint16{0x1301}, exts: []uint16{ExtALPN}}
	for _, tc := range []struct {
		name string
		mod  func(*helloSpec)
		want string // JA4 part a
	}{
		{"single-char alpn", func(s *helloSpec) { s.alpn = []string{"h"} }, "t12i0101hh"},
		{"non-alphanumeric alpn uses hex", func(s *helloSpec) { s.alpn = []string{"\xab\x01\xcd"} }, "t12i0101ad"},
		{"empty first alpn", func(s *helloSpec) { s.alpn = []string{"", "h2"} }, "t12i010100"},
		{"no alpn", func(s *helloSpec) { s.exts = nil }, "t12i010000"},
		{"tls 1.0 legacy version", func(s *helloSpec) { s.version = 0x0301; s.alpn = []string{"http/1.1"} }, "t10i0101h1"},
		{"unknown version", func(s *helloSpec) { s.version = 0x0399; s.alpn = []string{"x"} }, "t00i0101xx"},
		{"grease-only versions", func(s *helloSpec) {
			s.exts = append(s.exts, ExtSupportedVersions)
			s.versions = []uint16{0x0a0a}
			s.alpn = []string{"h2"}
		}, "t00i0102h2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := base
			tc.mod(&s)
			h, err := ParseClientHello(s.build())
			if err != nil {
				t.Fatal(err)
			}
			a, _, _ := h.ja4Parts()
			if a != tc.want {
				t.Errorf("JA4_a = %s, want %s", a, tc.want)
			}
		})
	}
	// No ciphers and no extensions besides ALPN: both hashes are zeros.
	s := helloSpec{exts: []uint16{ExtALPN}, alpn: []string{"h2"}}
	h, err := ParseClientHello(s.build())
	if err != nil {
		t.Fatal(err)
	}
	if got, want := h.JA4(), "t12i0001h2_000000000000_000000000000"; got != want {
		t.Errorf("JA4 = %s, want %s", got, want)
	}
}

func TestParseClientHelloSplitRecords(t *testing.T) {
	rec := chrome143(t).build()
	one, err := ParseClientHello(rec)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{1, 3, 100, 511} {
		split := splitRecords(rec, n)
		if got, err := HelloRecordsLen(split); err != nil || got != len(split) {
			t.Fatalf("HelloRecordsLen(split %d) = %d, %v; want %d", n, got, err, len(split))
		}
		for cut := 0; cut < len(split); cut += 97 {
			if got, err := HelloRecordsLen(split[:cut]); got != 0 || err != nil {
				t.Fatalf("HelloRecordsLen of %d of %d bytes = %d, %v; want 0, nil", cut, len(split), got, err)
			}
		}
		h, err := ParseClientHello(split)
		if err != nil {
			t.Fatalf("split %d: %v", n, err)
		}
		if !bytes.Equal(h.Raw, one.Raw) || h.JA4() != one.JA4() {
			t.Errorf("split %d: hello differs from the one-record parse", n)
		}
	}
}

func TestParseClientHelloRejects(t *testing.T) {
	rec := chrome143(t).build()
	dup := helloSpec{ciphers: []uint16{0x1301}, exts: []uint16{ExtSupportedVersions, ExtSupportedVersions}, versions: []uint16{0x0304}}.build()
	for name, b := range map[string][]byte{
		"empty":            nil,
		"plain http":       []byte("GET / HTTP/1.1\r\n\r\n"),
		"truncated":        rec[:len(rec)-1],
		"trailing byte":    append(append([]byte(nil), rec...), 0),
		"not a hello":      append([]byte{22, 3, 1, 0, 4}, 2, 0, 0, 0),
		"duplicate ext":    dup,
		"sslv2 compatible": {0x80, 0x2e, 0x01, 0x03, 0x01},
	} {
		if _, err := ParseClientHello(b); err == nil {
			t.Errorf("%s: parsed", name)
		}
	}
}

func TestIsGREASE(t *testing.T) {
	n := 0
	for v := 0; v <= 0xffff; v++ {
		if IsGREASE(uint16(v)) {
			n++
			if v&0xff != 0x0a+(v&0xf0) || v>>8 != v&0xff {
				t.Errorf("IsGREASE(%#04x)", v)
			}
		}
	}
	if n != 16 {
		t.Errorf("%d GREASE values, want 16", n)
	}
}

// TestHelloScannerSplitRecords: a HelloScanner fed a split hello one byte
// more at a time agrees with HelloRecordsLen on every prefix, and finds the
// hello's end exactly when its last byte arrives.
func TestHelloScannerSplitRecords(t *testing.T) {
	rec := chrome143(t).build()
	for _, n := range []int{1, 3, 100, len(rec)} {
		split := splitRecords(rec, n)
		checkScanner(t, split)
		var s HelloScanner
		for i := range len(split) + 1 {
			got, err := s.Scan(split[:i])
			if err != nil || (got != 0) != (i == len(split)) || i == len(split) && got != len(split) {
				t.Fatalf("split %d: Scan of %d of %d bytes = %d, %v", n, i, len(split), got, err)
			}
		}
	}
	// Not TLS: found on the first record header, as before.
	var s HelloScanner
	if _, err := s.Scan([]byte("GET / HTTP/1.1\r\n")); err != ErrNotHandshake {
		t.Errorf("plain HTTP: %v", err)
	}
}
