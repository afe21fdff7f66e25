package logtext

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"math"
	"testing"
	"time"
)

// same logs r through Handler and through slog.TextHandler and fails t if
// the bytes differ.
func same(t *testing.T, r slog.Record, opts *slog.HandlerOptions, derive func(slog.Handler) slog.Handler) {
	t.Helper()
	var ours, theirs bytes.Buffer
	h, want := New(&ours, opts), slog.Handler(slog.NewTextHandler(&theirs, opts))
	if derive != nil {
		h, want = derive(h), derive(want)
	}
	ctx := context.Background()
	if h.Enabled(ctx, r.Level) != want.Enabled(ctx, r.Level) {
		t.Fatalf("Enabled(%v): %v, TextHandler %v", r.Level, h.Enabled(ctx, r.Level), want.Enabled(ctx, r.Level))
	}
	if err := h.Handle(ctx, r.Clone()); err != nil {
		t.Fatal(err)
	}
	if err := want.Handle(ctx, r.Clone()); err != nil {
		t.Fatal(err)
	}
	if ours.String() != theirs.String() {
		t.Fatalf("wrote\n%q\nTextHandler wrote\n%q", ours.String(), theirs.String())
	}
}

func record(t time.Time, level slog.Level, msg string, attrs ...slog.Attr) slog.Record {
	r := slog.NewRecord(t, level, msg, 0)
	r.AddAttrs(attrs...)
	return r
}

type stringer struct{}

func (stringer) String() string { return "s" }

type valuer struct{}

func (valuer) LogValue() slog.Value { return slog.StringValue("resolved") }

// TestSameAsTextHandler: the access line, the fast kinds at their edges,
// quoting, and what Handler leaves to TextHandler, byte for byte.
func TestSameAsTextHandler(t *testing.T) {
	at := time.Date(2026, 12, 1, 17, 16, 55, 551_999_999, time.FixedZone("x", 3600))
	cases := map[string]slog.Record{
		"access line": record(at, slog.LevelInfo, "request", slog.String("method", "GET"), slog.String("host", "example.com:443"),
			slog.Int("status", 200), slog.Int64("bytes", 2048), slog.Duration("dur", 1234567*time.Nanosecond), slog.String("cache", "HIT")),
		"no time":           record(time.Time{}, slog.LevelWarn, "m", slog.Bool("b", true)),
		"utc, whole second": record(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), slog.LevelError, "m"),
		"levels":            record(at, slog.LevelDebug+3, "m"),
		"numbers": record(at, slog.LevelInfo, "m", slog.Int64("min", math.MinInt64), slog.Uint64("max", math.MaxUint64),
			slog.Duration("neg", -time.Hour), slog.Duration("zero", 0), slog.Bool("f", false)),
		"quoting": record(at, slog.LevelInfo, "a message", slog.String("", "x"), slog.String("k", ""),
			slog.String("sp ace", "a=b"), slog.String("q", `say "hi"`), slog.String("bs", `C:\path`),
			slog.String("nl", "a\nb"), slog.String("utf8", "héllo"), slog.String("bad", "\xff"),
			slog.String("nbsp", "a\u00a0b"), slog.String("del", "a\x7fb"), slog.String("ctl", "a\x01b")),
		"empty attr":   record(at, slog.LevelInfo, "m", slog.Attr{}, slog.String("k", "v")),
		"other kinds":  record(at, slog.LevelInfo, "m", slog.Float64("f", 1.5), slog.Time("t", at), slog.Any("err", errors.New("boom"))),
		"any":          record(at, slog.LevelInfo, "m", slog.Any("s", stringer{}), slog.Any("b", []byte("x y"))),
		"group":        record(at, slog.LevelInfo, "m", slog.Group("g", slog.Int("a", 1)), slog.String("after", "x")),
		"log valuer":   record(at, slog.LevelInfo, "m", slog.Any("v", valuer{})),
		"empty msg":    record(at, slog.LevelInfo, ""),
		"many attrs":   record(at, slog.LevelInfo, "m", slog.Int("a", 1), slog.Int("b", 2), slog.Int("c", 3), slog.Int("d", 4), slog.Int("e", 5), slog.Int("f", 6), slog.Int("g", 7)),
		"below level?": record(at, slog.LevelDebug, "m"),
	}
	for name, r := range cases {
		t.Run(name, func(t *testing.T) { same(t, r, nil, nil) })
	}
	t.Run("with attrs", func(t *testing.T) {
		same(t, cases["access line"], nil, func(h slog.Handler) slog.Handler { return h.WithAttrs([]slog.Attr{slog.String("component", "proxy")}) })
	})
	t.Run("with group", func(t *testing.T) {
		same(t, cases["access line"], nil, func(h slog.Handler) slog.Handler { return h.WithGroup("g") })
	})
	t.Run("level option", func(t *testing.T) {
		lv := new(slog.LevelVar)
		lv.Set(slog.LevelWarn)
		same(t, cases["numbers"], &slog.HandlerOptions{Level: lv}, nil)
		same(t, cases["no time"], &slog.HandlerOptions{Level: lv}, nil)
	})
	t.Run("replace attr", func(t *testing.T) {
		opts := &slog.HandlerOptions{ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == "host" {
				a.Value = slog.StringValue("hidden")
			}
			return a
		}}
		same(t, cases["access line"], opts, nil)
	})
}

// FuzzSameAsTextHandler holds Handler to TextHandler's bytes on records of
// the kinds it writes itself.
func FuzzSameAsTextHandler(f *testing.F) {
	f.Add("request", "host", "example.com", int64(200), uint64(2048), int64(1234567), true, int64(1764609415551999999))
	f.Add("", "", "", int64(-1), uint64(0), int64(-1), false, int64(0))
	f.Add("a b", "k=v", "\"\\\xff\u00a0", int64(math.MinInt64), uint64(math.MaxUint64), int64(math.MaxInt64), true, int64(-62135596800000000))
	f.Fuzz(func(t *testing.T, msg, key, s string, i int64, u uint64, d int64, bo bool, ns int64) {
		r := record(time.Unix(0, ns).In(time.FixedZone("z", int(i%50000))), slog.Level(i%20), msg,
			slog.String(key, s), slog.Int64("i", i), slog.Uint64(key+"u", u), slog.Duration("d", time.Duration(d)), slog.Bool(s, bo))
		same(t, r, &slog.HandlerOptions{Level: slog.LevelDebug - 20}, nil)
	})
}

// TestFastPathTaken: the access line is written by Handler itself, not
// passed on (a Handler that always passed records on would pass the tests
// above, and cost what TextHandler costs).
func TestFastPathTaken(t *testing.T) {
	r := record(time.Now(), slog.LevelInfo, "request", slog.String("method", "GET"), slog.Int("status", 200), slog.Duration("dur", time.Millisecond))
	if _, ok := appendRecord(nil, r); !ok {
		t.Fatal("the access line was passed on to TextHandler")
	}
	if _, ok := appendRecord(nil, record(time.Now(), slog.LevelInfo, "m", slog.Any("err", errors.New("x")))); ok {
		t.Fatal("an Any attribute was written, not passed on")
	}
	h := New(discard{}, nil)
	allocs := testing.AllocsPerRun(100, func() { _ = h.Handle(context.Background(), r) })
	if allocs > 1 {
		t.Fatalf("%.0f allocations per line, want at most 1 (the duration's string)", allocs)
	}
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// BenchmarkAccessLine is the proxy's access line through Handler and
// through slog.TextHandler: the handler alone (Handle), through
// slog.Logger.LogAttrs, and as the proxy logs it (a record made without
// the caller's program counter, which LogAttrs walks the stack for).
func BenchmarkAccessLine(b *testing.B) {
	attrs := []slog.Attr{slog.String("method", "GET"), slog.String("host", "example.com:443"),
		slog.Int("status", 200), slog.Int64("bytes", 2048), slog.Duration("dur", 1234567*time.Nanosecond), slog.String("cache", "HIT")}
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		h    slog.Handler
	}{{"logtext", New(discard{}, nil)}, {"slog.TextHandler", slog.NewTextHandler(discard{}, nil)}} {
		b.Run(tc.name+"/Handle", func(b *testing.B) {
			r := record(time.Now(), slog.LevelInfo, "request", attrs...)
			for b.Loop() {
				_ = tc.h.Handle(ctx, r)
			}
		})
		b.Run(tc.name+"/LogAttrs", func(b *testing.B) {
			l := slog.New(tc.h)
			for b.Loop() {
				l.LogAttrs(ctx, slog.LevelInfo, "request", attrs...)
			}
		})
		b.Run(tc.name+"/record-without-pc", func(b *testing.B) {
			for b.Loop() {
				r := slog.NewRecord(time.Now(), slog.LevelInfo, "request", 0)
				r.AddAttrs(attrs...)
				_ = tc.h.Handle(ctx, r)
			}
		})
	}
}
