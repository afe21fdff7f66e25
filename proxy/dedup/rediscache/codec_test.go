package rediscache

import (
	"bytes"
	"crypto/rand"
	"errors"
	"net/http"
	"reflect"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

func TestCodecRoundTrip(t *testing.T) {
	binary := make([]byte, 70000)
	rand.Read(binary)
	now := time.UnixMilli(time.Now().UnixMilli())
	for _, tc := range []struct {
		name     string
		e        *dedup.Entry
		wantZstd bool
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
			blob := encode(tc.e)
			if zstd := blob[len(magic)+1]&flagZstd != 0; zstd != tc.wantZstd {
				t.Errorf("compressed = %v, want %v", zstd, tc.wantZstd)
			}
			got, err := decode(blob)
			if err != nil {
				t.Fatal(err)
			}
			if tc.e.Vary == nil {
				tc.e.Vary = nil
			}
			if !reflect.DeepEqual(got.Header, tc.e.Header) || !bytes.Equal(got.Body, tc.e.Body) || got.Status != tc.e.Status ||
				!got.StoredAt.Equal(tc.e.StoredAt) || !got.ExpiresAt.Equal(tc.e.ExpiresAt) || got.URLKey != tc.e.URLKey ||
				!reflect.DeepEqual(got.Vary, tc.e.Vary) {
				t.Fatalf("round trip changed the entry:\n got %+v\nwant %+v", got, tc.e)
			}
		})
	}
}

func TestCodecRejectsOtherFormats(t *testing.T) {
	blob := encode(&dedup.Entry{Status: 200, Header: http.Header{"A": {"b"}}, Body: []byte("body")})
	for name, b := range map[string][]byte{
		"empty":         nil,
		"other version": append([]byte(magic+"\x00"), blob[len(magic)+1:]...),
		"newer version": append([]byte(magic+"\x02"), blob[len(magic)+1:]...),
		"bad magic":     append([]byte("NOPE"), blob[len(magic):]...),
		"truncated":     blob[:len(blob)-2],
		"trailing":      append(append([]byte{}, blob...), 0),
		"unknown flag":  append(append([]byte(magic), formatVersion, 0x80), blob[len(magic)+2:]...),
	} {
		if _, err := decode(b); !errors.Is(err, errFormat) {
			t.Errorf("%s: err = %v, want errFormat", name, err)
		}
	}
}

func FuzzDecode(f *testing.F) {
	f.Add(encode(&dedup.Entry{Status: 200, Header: http.Header{"A": {"b"}}, Body: []byte("x")}))
	f.Add(encode(&dedup.Entry{Status: 200, Header: http.Header{"Content-Type": {"text/plain"}}, Body: bytes.Repeat([]byte("ab"), 2000)}))
	f.Add([]byte(magic + "\x01\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := decode(b)
		if err != nil {
			return
		}
		// Whatever decodes must survive another round trip unchanged.
		again, err := decode(encode(e))
		if err != nil || again.Status != e.Status || !bytes.Equal(again.Body, e.Body) || !reflect.DeepEqual(again.Header, e.Header) {
			t.Fatalf("re-encode changed a decoded entry: %v", err)
		}
	})
}

func TestOutcomeCodec(t *testing.T) {
	for _, o := range []dedup.Outcome{
		{Err: "dial tcp: connection refused"},
		{Err: "timeout", Timeout: true},
		{Entry: &dedup.Entry{Status: 500, Header: http.Header{}, Body: []byte("boom")}},
	} {
		got, err := decodeOutcome(encodeOutcome(o))
		if err != nil || got.Err != o.Err || got.Timeout != o.Timeout || (o.Entry != nil) != (got.Entry != nil) {
			t.Fatalf("%+v → %+v, %v", o, got, err)
		}
	}
	if _, err := decodeOutcome([]byte("Q")); err == nil {
		t.Fatal("unknown outcome kind accepted")
	}
}

func TestConfigValidate(t *testing.T) {
	err := Config{URL: "redis://a:1", Addrs: []string{"b"}, MasterName: "m", DialTimeout: -1, Lease: time.Millisecond, PresenceTTL: time.Second, Timeout: time.Second, BreakerFailures: -1, MaxValueBytes: 1}.Validate()
	for _, want := range []string{"url: set either", "addrs[0]:", "dial_timeout:", "lease:", "presence_ttl:", "breaker_failures:", "max_value_bytes:"} {
		if err == nil || !bytes.Contains([]byte(err.Error()), []byte(want)) {
			t.Errorf("missing %q in %v", want, err)
		}
	}
	if err := (Config{URL: "redis://127.0.0.1:6379/0"}).WithDefaults().Validate(); err != nil {
		t.Fatal(err)
	}
	// presence_ttl follows a longer timeout unless set.
	if c := (Config{URL: "redis://127.0.0.1:6379/0", Timeout: 2 * time.Second, Lease: 10 * time.Second}).WithDefaults(); c.PresenceTTL != 6*time.Second || c.Validate() != nil {
		t.Fatalf("presence_ttl %s with timeout 2s: %v", c.PresenceTTL, c.Validate())
	}
	if c := (Config{}).WithDefaults(); c.PresenceTTL != 1500*time.Millisecond {
		t.Fatalf("default presence_ttl %s", c.PresenceTTL)
	}
	if err := (Config{URL: "http://nope"}).WithDefaults().Validate(); err == nil {
		t.Fatal("bad URL accepted")
	}
}
