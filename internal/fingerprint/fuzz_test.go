package fingerprint

import (
	"bufio"
	"bytes"
	"net/http"
	"reflect"
	"regexp"
	"strings"
	"testing"
)

var ja4Format = regexp.MustCompile(`^t(13|12|11|10|s3|s2|00)[di]\d{4}[0-9A-Za-z]{2}_[0-9a-f]{12}_[0-9a-f]{12}$`)

// FuzzParseClientHello holds the hello parser to a round trip: whatever it
// accepts, re-encoded from the parsed fields, is the record it kept, and
// parses again to the same value; the record framing it accepted is
// exactly what HelloRecordsLen measures, and what a HelloScanner fed the
// bytes a few at a time measures; JA4 is well formed.
func FuzzParseClientHello(f *testing.F) {
	rec := chrome143(f).build()
	f.Add(rec)
	f.Add(splitRecords(rec, 200))
	f.Add(helloSpec{ciphers: []uint16{0x1301}}.build())
	f.Add(helloSpec{ciphers: []uint16{0x1301}, exts: []uint16{ExtALPN, ExtServerName}, alpn: []string{"\x00"}, sni: "a"}.build())
	f.Fuzz(func(t *testing.T, b []byte) {
		n, lenErr := HelloRecordsLen(b)
		checkScanner(t, b)
		h, err := ParseClientHello(b)
		if err != nil {
			if lenErr == nil && n == len(b) && n > 0 {
				// The framing is complete, so the message itself is bad;
				// it must then fail to parse from the joined record too.
				msg, _, jerr := joinRecords(b)
				if jerr != nil {
					t.Fatalf("HelloRecordsLen accepted what joinRecords refuses: %v", jerr)
				}
				if _, perr := parseMessage(msg); perr == nil {
					t.Fatalf("ParseClientHello failed (%v) on a parseable message", err)
				}
			}
			return
		}
		if lenErr != nil || n != len(b) {
			t.Fatalf("parsed, but HelloRecordsLen = %d, %v of %d bytes", n, lenErr, len(b))
		}
		if m := h.marshal(); !bytes.Equal(m, h.Raw) {
			t.Fatalf("re-encoded hello differs from Raw:\n%x\n%x", m, h.Raw)
		}
		again, err := ParseClientHello(h.Raw)
		if err != nil {
			t.Fatalf("Raw does not parse: %v", err)
		}
		if !reflect.DeepEqual(again, h) {
			t.Fatalf("parse of Raw differs:\n%+v\n%+v", again, h)
		}
		if j := h.JA4(); !ja4Format.MatchString(j) {
			t.Fatalf("JA4 %q malformed", j)
		}
		_ = h.JA3Hash()
		_ = New(h, nil).ID()
	})
}

// checkScanner feeds b to a HelloScanner in growing prefixes, as reads
// would, and holds it to HelloRecordsLen on each prefix until either
// returns a result.
func checkScanner(t *testing.T, b []byte) {
	t.Helper()
	var s HelloScanner
	step := 1 + len(b)/64 // every prefix of a small input
	for i := 0; ; i = min(i+step, len(b)) {
		n, err := s.Scan(b[:i])
		wantN, wantErr := HelloRecordsLen(b[:i])
		if n != wantN || (err == nil) != (wantErr == nil) {
			t.Fatalf("%d of %d bytes: HelloScanner %d, %v; HelloRecordsLen %d, %v", i, len(b), n, err, wantN, wantErr)
		}
		if n != 0 || err != nil || i == len(b) {
			return
		}
	}
}

// FuzzH2Decoder holds the HTTP/2 decoder to its streaming contract: the
// result (error or not, preface, requests) does not depend on how the bytes
// are cut into Writes; and to its bounds. The fuzzer writes what follows
// the 24-byte preface.
func FuzzH2Decoder(f *testing.F) {
	f.Add(chromeConn(f)[len(ClientPreface):], uint16(1))
	f.Add(chromeConn(f)[len(ClientPreface):], uint16(9))
	f.Add([]byte{}, uint16(3))
	f.Fuzz(func(t *testing.T, frames []byte, step uint16) {
		b := append([]byte(ClientPreface), frames...)
		whole := NewH2Decoder(4096)
		_, errWhole := whole.Write(b)
		parts := NewH2Decoder(4096)
		var errParts error
		var reqs []H2Request
		s := int(step%64) + 1
		for i := 0; i < len(b) && errParts == nil; i += s {
			_, errParts = parts.Write(b[i:min(i+s, len(b))])
			reqs = append(reqs, parts.Requests()...)
		}
		if (errWhole == nil) != (errParts == nil) {
			t.Fatalf("whole: %v; in steps of %d: %v", errWhole, s, errParts)
		}
		if errWhole != nil {
			return
		}
		if !reflect.DeepEqual(whole.Preface(), parts.Preface()) {
			t.Fatalf("prefaces differ: %+v vs %+v", whole.Preface(), parts.Preface())
		}
		if got := whole.Requests(); !reflect.DeepEqual(got, reqs) {
			t.Fatalf("requests differ: %+v vs %+v", got, reqs)
		}
		// What the decoder keeps is bounded whatever the client sends, and
		// every request it reports opened a new client stream.
		if p := whole.Preface(); p != nil {
			if len(p.Priorities) > maxPrefacePriorities {
				t.Fatalf("%d PRIORITY frames kept", len(p.Priorities))
			}
			_ = p.Akamai()
		}
		var last uint32
		for _, r := range reqs {
			if r.StreamID%2 == 0 || r.StreamID <= last {
				t.Fatalf("request on stream %d after stream %d", r.StreamID, last)
			}
			last = r.StreamID
			if n := len(r.Shape.PseudoOrder) + len(r.Shape.HeaderOrder); n > maxHeaderList/32 {
				t.Fatalf("request with %d fields", n)
			}
		}
	})
}

// FuzzParseH1Head holds the HTTP/1.x head parser to net/http: on a head
// both accept, the names it reports are the fields net/http read.
func FuzzParseH1Head(f *testing.F) {
	f.Add("GET / HTTP/1.1\r\nHost: a\r\nUser-Agent: x\r\nAccept: */*\r\n\r\n")
	f.Add("POST /p HTTP/1.1\r\nhost: a\r\ncontent-length: 3\r\nX: 1\r\n 2\r\n\r\n")
	f.Add("GET / HTTP/1.0\nA: 1\n\n")
	f.Fuzz(func(t *testing.T, head string) {
		r, err := ParseH1Head([]byte(head))
		if err != nil {
			return
		}
		if len(r.Shape.HeaderOrder) != len(r.Fields) {
			t.Fatalf("%d names for %d fields", len(r.Shape.HeaderOrder), len(r.Fields))
		}
		req, err := http.ReadRequest(bufio.NewReader(strings.NewReader(head)))
		if err != nil {
			return
		}
		if req.Method != r.Method || req.RequestURI != r.Target {
			t.Fatalf("request line %q %q; net/http %q %q", r.Method, r.Target, req.Method, req.RequestURI)
		}
		ours := map[string]bool{}
		for _, n := range r.Shape.HeaderOrder {
			ours[http.CanonicalHeaderKey(n)] = true
		}
		for k := range req.Header {
			if !ours[k] {
				t.Fatalf("net/http read field %q, ParseH1Head did not (%q)", k, r.Shape.HeaderOrder)
			}
		}
		for k := range ours {
			if _, ok := req.Header[k]; !ok && k != "Host" && k != "Transfer-Encoding" {
				t.Fatalf("ParseH1Head read field %q, net/http did not (%v)", k, req.Header)
			}
		}
	})
}
