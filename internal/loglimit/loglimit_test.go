package loglimit

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// logAt writes one record at t through h, as a slog.Logger would.
func logAt(t *testing.T, h slog.Handler, at time.Time, level slog.Level, msg string, args ...any) {
	t.Helper()
	r := slog.NewRecord(at, level, msg, 0)
	r.Add(args...)
	if err := h.Handle(context.Background(), r); err != nil {
		t.Fatal(err)
	}
}

// lines parses the JSON lines written to buf.
func lines(t *testing.T, buf *bytes.Buffer) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		if l == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("%q: %v", l, err)
		}
		out = append(out, m)
	}
	return out
}

func count(ls []map[string]any, msg string) int {
	n := 0
	for _, l := range ls {
		if l["msg"] == msg {
			n++
		}
	}
	return n
}

// TestLogLimitSaysWhatItLeftOut: a flood of one warning lets Burst lines
// through per window, and the lines left out are said, never silently
// lost: by the next line of the message once the window is over, or by a
// summary line when that message does not come again.
func TestLogLimitSaysWhatItLeftOut(t *testing.T) {
	var buf bytes.Buffer
	h := New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}), Config{})
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	// A logger's attributes make no other message.
	derived := h.WithAttrs([]slog.Attr{slog.String("part", "proxy")})
	for i := range 300 {
		at := t0.Add(time.Duration(i) * time.Millisecond)
		target := fmt.Sprintf("bad%d", i)
		if i%2 == 0 {
			logAt(t, h, at, slog.LevelWarn, "refused CONNECT", "target", target)
		} else {
			logAt(t, derived, at, slog.LevelWarn, "refused CONNECT", "target", target)
		}
		logAt(t, h, at, slog.LevelInfo, "request", "n", i) // access lines: never limited
	}
	ls := lines(t, &buf)
	if got := count(ls, "refused CONNECT"); got != DefaultBurst {
		t.Errorf("%d lines of a flood of 300 in one window, want %d", got, DefaultBurst)
	}
	if got := count(ls, "request"); got != 300 {
		t.Errorf("%d of 300 info lines written: info must pass untouched", got)
	}
	if got := h.Suppressed(); got != 300-DefaultBurst {
		t.Errorf("Suppressed() = %d, want %d", got, 300-DefaultBurst)
	}

	// The window is over: the next line of the message says how many
	// the last one left out, and counts anew.
	buf.Reset()
	logAt(t, h, t0.Add(DefaultWindow+time.Second), slog.LevelWarn, "refused CONNECT", "target", "late")
	ls = lines(t, &buf)
	if len(ls) != 1 || ls[0]["msg"] != "refused CONNECT" || ls[0]["suppressed"] != float64(300-DefaultBurst) {
		t.Fatalf("next line after the window: %v, want it to carry suppressed=%d", ls, 300-DefaultBurst)
	}

	// A flood that stops: the next warning of any other message, after
	// the window, brings a summary line naming the message and the count.
	buf.Reset()
	t1 := t0.Add(time.Minute)
	for i := range 50 {
		logAt(t, h, t1.Add(time.Duration(i)*time.Millisecond), slog.LevelError, "request failed")
	}
	logAt(t, h, t1.Add(DefaultWindow+time.Second), slog.LevelWarn, "something else")
	ls = lines(t, &buf)
	var summary map[string]any
	for _, l := range ls {
		if l["msg"] == SuppressedMsg {
			summary = l
		}
	}
	if summary == nil || summary["message"] != "request failed" || summary["suppressed"] != float64(50-DefaultBurst) || summary["level"] != "ERROR" {
		t.Fatalf("no summary of the flood that stopped (want message=%q suppressed=%d level=ERROR) in %v", "request failed", 50-DefaultBurst, ls)
	}
	if got := count(ls, "something else"); got != 1 {
		t.Errorf("the line that brought the summary: %d written", got)
	}
	// Said once: neither a summary again nor a count on the next line.
	buf.Reset()
	logAt(t, h, t1.Add(2*DefaultWindow+2*time.Second), slog.LevelError, "request failed")
	logAt(t, h, t1.Add(2*DefaultWindow+2*time.Second), slog.LevelWarn, "something else")
	for _, l := range lines(t, &buf) {
		if l["msg"] == SuppressedMsg || l["suppressed"] != nil {
			t.Errorf("a count said twice: %v", l)
		}
	}
}

// TestLogLimitBoundsMessages: lines whose message differs by an address
// or a port (net/http's error log prints them into the message) are one
// message; lines of more distinct messages than MaxMessages share one
// budget, so neither memory nor the lines written grow with them.
func TestLogLimitBoundsMessages(t *testing.T) {
	var buf bytes.Buffer
	h := New(slog.NewJSONHandler(&buf, nil), Config{MaxMessages: 8})
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for i := range 500 {
		logAt(t, h, t0, slog.LevelWarn, fmt.Sprintf("http: TLS handshake error from 192.0.2.%d:%d: EOF", i%250, 40000+i))
		logAt(t, h, t0, slog.LevelWarn, fmt.Sprintf("http: TLS handshake error from [2001:db8::%x]:%d: EOF", i, 40000+i))
	}
	// IPv4 or IPv6, the client's address is no part of the message.
	if got := len(lines(t, &buf)); got != DefaultBurst {
		t.Errorf("%d lines for 1000 lines of one message from many clients, want %d", got, DefaultBurst)
	}
	buf.Reset()
	letters := func(i int) string {
		return string(rune('a'+i%26)) + string(rune('a'+i/26%26)) + string(rune('a'+i/676%26))
	}
	for i := range 5000 {
		logAt(t, h, t0, slog.LevelWarn, "goproxy: WARN: "+letters(i))
	}
	h.st.mu.Lock()
	tracked := len(h.st.msgs)
	h.st.mu.Unlock()
	if tracked > 8 {
		t.Errorf("%d messages tracked, want at most MaxMessages (8)", tracked)
	}
	if got, most := len(lines(t, &buf)), 8*DefaultBurst; got > most {
		t.Errorf("%d lines for 5000 distinct messages, want at most %d", got, most)
	}
	buf.Reset()
	logAt(t, h, t0.Add(DefaultWindow), slog.LevelWarn, "later")
	var said int
	for _, l := range lines(t, &buf) {
		if l["msg"] == SuppressedMsg {
			said += int(l["suppressed"].(float64))
		}
	}
	if int64(said) != h.Suppressed() {
		t.Errorf("summaries say %d lines were left out, Suppressed() = %d", said, h.Suppressed())
	}
}

// TestFlushSaysWhatTheLastWindowLeftOut: what a window left out is said
// at Flush (the process stopping) when no later line came to say it,
// once: neither a second Flush nor the message's next line says it again.
func TestFlushSaysWhatTheLastWindowLeftOut(t *testing.T) {
	var buf bytes.Buffer
	h := New(slog.NewJSONHandler(&buf, nil), Config{})
	now := time.Now()
	for range 30 {
		logAt(t, h, now, slog.LevelWarn, "refused CONNECT")
	}
	h.Flush(context.Background())
	h.Flush(context.Background())
	logAt(t, h, now.Add(DefaultWindow), slog.LevelWarn, "refused CONNECT")
	ls := lines(t, &buf)
	var said []any
	for _, l := range ls {
		if l["msg"] == SuppressedMsg {
			said = append(said, l["suppressed"])
		}
		if l["msg"] == "refused CONNECT" && l["suppressed"] != nil {
			said = append(said, l["suppressed"])
		}
	}
	if fmt.Sprint(said) != "[10]" {
		t.Errorf("the 10 lines left out were said %v, want once: [10]", said)
	}
}
