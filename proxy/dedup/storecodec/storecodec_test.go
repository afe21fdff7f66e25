package storecodec

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"golang.org/x/net/http/httpguts"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

func TestRoundTrip(t *testing.T) {
	binary := make([]byte, 70000)
	rand.Read(binary)
	now := time.UnixMilli(time.Now().UnixMilli())
	for _, tc := range []struct {
		name   string
		e      *dedup.Entry
		wantS2 bool
	}{
		{"binary body", &dedup.Entry{
			Status: 200,
			Header: http.Header{"Content-Type": {"application/octet-stream"}, "X-Multi": {"a", "b", ""}, "Set-Cookie": {"a=1", "b=2"}},
			Body:   binary, StoredAt: now, ExpiresAt: now.Add(time.Minute), URLKey: "u1:abc",
		}, false},
		{"compressible html", &dedup.Entry{
			Status: 404,
			Header: http.Header{"Content-Type": {"text/html; charset=utf-8"}},
			Body:   bytes.Repeat([]byte("<div>hello</div>"), 500), StoredAt: now, ExpiresAt: now.Add(time.Hour),
			Vary: []dedup.HeaderValue{{Name: "User-Agent", Value: "x"}, {Name: "X-Empty", Value: ""}},
		}, true},
		{"already gzip", &dedup.Entry{
			Status: 200,
			Header: http.Header{"Content-Type": {"text/html"}, "Content-Encoding": {"gzip"}},
			Body:   bytes.Repeat([]byte("z"), 5000), StoredAt: now, ExpiresAt: now.Add(time.Hour),
		}, false},
		{"empty 204", &dedup.Entry{Status: 204, Header: http.Header{}, Body: []byte{}, StoredAt: now, ExpiresAt: now}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			blob := Encode(tc.e)
			if s2 := blob[len(magic)+1]&flagS2 != 0; s2 != tc.wantS2 {
				t.Errorf("compressed = %v, want %v", s2, tc.wantS2)
			}
			got, err := Decode(blob)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got.Header, tc.e.Header) || !bytes.Equal(got.Body, tc.e.Body) || got.Status != tc.e.Status ||
				!got.StoredAt.Equal(tc.e.StoredAt) || !got.ExpiresAt.Equal(tc.e.ExpiresAt) || got.URLKey != tc.e.URLKey ||
				!reflect.DeepEqual(got.Vary, tc.e.Vary) {
				t.Fatalf("round trip changed the entry:\n got %+v\nwant %+v", got, tc.e)
			}
		})
	}
}

func TestRejectsOtherFormats(t *testing.T) {
	blob := Encode(&dedup.Entry{Status: 200, Header: http.Header{"A": {"b"}}, Body: []byte("body")})
	big := Encode(&dedup.Entry{Status: 200, Header: http.Header{"Content-Type": {"text/plain"}}, Body: bytes.Repeat([]byte("ab"), 4000)})
	if big[len(magic)+1]&flagS2 == 0 {
		t.Fatal("the compressible value was not compressed")
	}
	oldZstd := zstdValue(t, &dedup.Entry{Status: 200, Header: http.Header{}, Body: bytes.Repeat([]byte("ab"), 4000)})
	for name, b := range map[string][]byte{
		"empty":          nil,
		"magic only":     []byte(magic),
		"other version":  append([]byte(magic+"\x00"), blob[len(magic)+1:]...),
		"newer version":  append([]byte(magic+"\x02"), blob[len(magic)+1:]...),
		"bad magic":      append([]byte("NOPE"), blob[len(magic):]...),
		"truncated":      blob[:len(blob)-2],
		"trailing":       append(append([]byte{}, blob...), 0),
		"unknown flag":   append(append([]byte(magic), Version, 0x80), blob[len(magic)+2:]...),
		"s2 truncated":   big[:len(big)-3],
		"both codecs":    append(append([]byte(magic), Version, flagS2|flagZstd), big[len(magic)+2:]...),
		"zstd truncated": oldZstd[:len(oldZstd)-3],
		"header CRLF":    Encode(&dedup.Entry{Status: 200, Header: http.Header{"A": {"b\r\nSet-Cookie: x=1"}}}),
		"header name":    Encode(&dedup.Entry{Status: 200, Header: http.Header{"Bad Name": {"v"}}}),
		"status 42":      Encode(&dedup.Entry{Status: 42, Header: http.Header{}}),
	} {
		if _, err := Decode(b); !errors.Is(err, ErrFormat) {
			t.Errorf("%s: err = %v, want ErrFormat", name, err)
		}
	}
	// A body past the reader's bound is refused, compressed or not.
	if _, err := DecodeLimit(big, 7999); !errors.Is(err, ErrFormat) {
		t.Errorf("compressed body over the limit: %v", err)
	}
	if _, err := DecodeLimit(big, 8000); err != nil {
		t.Errorf("compressed body at the limit: %v", err)
	}
	if _, err := DecodeLimit(blob, 3); !errors.Is(err, ErrFormat) {
		t.Errorf("plain body over the limit: %v", err)
	}
}

// FuzzDecode: whatever decodes is a response an HTTP server can write
// (status in range, valid header names and values) and survives another
// round trip unchanged. No recover: a panic fails the fuzzer.
func FuzzDecode(f *testing.F) {
	f.Add(Encode(&dedup.Entry{Status: 200, Header: http.Header{"A": {"b"}}, Body: []byte("x")}))
	f.Add(Encode(&dedup.Entry{Status: 200, Header: http.Header{"Content-Type": {"text/plain"}}, Body: bytes.Repeat([]byte("ab"), 2000),
		Vary: []dedup.HeaderValue{{Name: "Accept", Value: "*/*"}}, URLKey: "u1:ff"}))
	f.Add([]byte(magic + "\x01\x00"))
	f.Add([]byte(magic + "\x01\x01\xc8\x01\x00\x00\x00\x00\x00\x05abcde"))
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := DecodeLimit(b, 1<<20)
		if err != nil {
			if !errors.Is(err, ErrFormat) {
				t.Fatalf("error %v does not wrap ErrFormat", err)
			}
			return
		}
		if e.Status < 100 || e.Status > 999 || e.Header == nil || len(e.Body) > 1<<20 {
			t.Fatalf("accepted %+v", e)
		}
		for k, vs := range e.Header {
			if !httpguts.ValidHeaderFieldName(k) {
				t.Fatalf("accepted header name %q", k)
			}
			for _, v := range vs {
				if !httpguts.ValidHeaderFieldValue(v) {
					t.Fatalf("accepted header value %q", v)
				}
			}
		}
		again, err := DecodeLimit(Encode(e), 1<<20)
		if err != nil || again.Status != e.Status || !bytes.Equal(again.Body, e.Body) || !reflect.DeepEqual(again.Header, e.Header) ||
			again.URLKey != e.URLKey || !reflect.DeepEqual(again.Vary, e.Vary) || !again.StoredAt.Equal(e.StoredAt) || !again.ExpiresAt.Equal(e.ExpiresAt) {
			t.Fatalf("re-encode changed a decoded entry: %v", err)
		}
	})
}

// TestReadsOlderZstdValues: values older versions wrote, zstd-compressed,
// still read, within the same bound on what they inflate to.
func TestReadsOlderZstdValues(t *testing.T) {
	e := &dedup.Entry{Status: 200, Header: http.Header{"Content-Type": {"text/html"}}, Body: bytes.Repeat([]byte("<p>older</p>"), 1000), URLKey: "u1:ab"}
	old := zstdValue(t, e)
	got, err := Decode(old)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Body, e.Body) || !reflect.DeepEqual(got.Header, e.Header) || got.URLKey != e.URLKey {
		t.Fatalf("decoded %+v", got)
	}
	if _, err := DecodeLimit(old, int64(len(e.Body))-1); !errors.Is(err, ErrFormat) {
		t.Errorf("zstd body over the limit: %v", err)
	}
}

// zstdValue encodes e as versions before S2 did: its body zstd-compressed.
func zstdValue(t *testing.T, e *dedup.Entry) []byte {
	t.Helper()
	enc, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest))
	if err != nil {
		t.Fatal(err)
	}
	head := *e
	head.Body = nil // too short to compress: ends with its length, 0
	b := Encode(&head)
	if b[len(magic)+1] != 0 || b[len(b)-1] != 0 {
		t.Fatalf("unexpected encoding %x", b)
	}
	z := enc.EncodeAll(e.Body, nil)
	b[len(magic)+1] = flagZstd
	b = binary.AppendUvarint(b[:len(b)-1], uint64(len(z)))
	return append(b, z...)
}

func TestOutcome(t *testing.T) {
	for _, o := range []dedup.Outcome{
		{Err: "dial tcp: connection refused"},
		{Err: "timeout", Timeout: true},
		{Entry: &dedup.Entry{Status: 500, Header: http.Header{}, Body: []byte("boom")}},
	} {
		got, err := DecodeOutcome(EncodeOutcome(o), 1<<20)
		if err != nil || got.Err != o.Err || got.Timeout != o.Timeout || (o.Entry != nil) != (got.Entry != nil) {
			t.Fatalf("%+v → %+v, %v", o, got, err)
		}
	}
	for _, b := range [][]byte{nil, []byte("Q"), []byte("Egarbage")} {
		if _, err := DecodeOutcome(b, 1<<20); !errors.Is(err, ErrFormat) {
			t.Errorf("%q: err = %v, want ErrFormat", b, err)
		}
	}
}

// FuzzDecodeOutcome: an outcome is an entry or a failure, never both.
func FuzzDecodeOutcome(f *testing.F) {
	f.Add(EncodeOutcome(dedup.Outcome{Err: "x"}))
	f.Add(EncodeOutcome(dedup.Outcome{Entry: &dedup.Entry{Status: 200, Header: http.Header{}}}))
	f.Fuzz(func(t *testing.T, b []byte) {
		o, err := DecodeOutcome(b, 1<<20)
		if err != nil {
			if !errors.Is(err, ErrFormat) {
				t.Fatalf("error %v does not wrap ErrFormat", err)
			}
			return
		}
		if o.Entry != nil && (o.Err != "" || o.Timeout) {
			t.Fatalf("both an entry and a failure: %+v", o)
		}
	})
}

// TestCompressibleMediaTypes: the media type is read without its
// parameters and case, as mime.ParseMediaType reads it.
func TestCompressibleMediaTypes(t *testing.T) {
	for ct, want := range map[string]bool{
		"text/html":                    true,
		"Text/HTML; charset=utf-8":     true,
		" application/json ;q=1":       true,
		"application/problem+json;x=y": true,
		"image/svg+xml":                true,
		"application/octet-stream":     false,
		"image/png":                    false,
		"":                             false,
	} {
		if got := compressible(http.Header{"Content-Type": {ct}}); got != want {
			t.Errorf("compressible(%q) = %v, want %v", ct, got, want)
		}
	}
	if compressible(http.Header{"Content-Type": {"text/html"}, "Content-Encoding": {"gzip"}}) {
		t.Error("a gzip-encoded body counted as compressible")
	}
}

// TestConcurrentEncodes: values encoded at once through the pooled
// compression buffers each decode to their own body.
func TestConcurrentEncodes(t *testing.T) {
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 200 {
				body := []byte(strings.Repeat(fmt.Sprintf("<p>%d-%d</p>", g, i), 200+i))
				e := &dedup.Entry{Status: 200, Header: http.Header{"Content-Type": {"text/html"}}, Body: body}
				got, err := Decode(Encode(e))
				if err != nil || !bytes.Equal(got.Body, body) {
					t.Errorf("goroutine %d value %d: %v, body equal %v", g, i, err, err == nil && bytes.Equal(got.Body, body))
					return
				}
			}
		})
	}
	wg.Wait()
}

// TestAppendEncode: AppendEncode keeps what dst holds and appends the very
// bytes Encode returns, into dst's own array when it has room.
func TestAppendEncode(t *testing.T) {
	e := &dedup.Entry{Status: 200, Header: http.Header{"Content-Type": {"text/html"}}, Body: bytes.Repeat([]byte("<p>x</p>"), 500), URLKey: "u1:ab"}
	want := Encode(e)
	dst := make([]byte, 3, 64<<10)
	copy(dst, "abc")
	got := AppendEncode(dst, e)
	if string(got[:3]) != "abc" || !bytes.Equal(got[3:], want) {
		t.Fatalf("AppendEncode = %q…, want abc + Encode's %d bytes", got[:min(len(got), 16)], len(want))
	}
	if &got[0] != &dst[0] {
		t.Error("AppendEncode allocated although dst had room")
	}
	if _, err := Decode(got[3:]); err != nil {
		t.Fatal(err)
	}
}
