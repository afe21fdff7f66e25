// Package loglimit keeps warnings and errors from filling a disk. A
// client can make the proxy warn at will (a refused CONNECT, a malformed
// request: one line each, before any authentication), so a flood of them
// is a flood of lines, with the access log off or not. Handler, a
// slog.Handler wrapper, lets at most Burst lines of one message through
// per Window; the lines it leaves out are counted and said: the next line
// of that message carries "suppressed": N, or, when none comes in time, a
// "log lines suppressed" line names the message and N. Records below Warn
// (access lines, debug) pass untouched.
//
// Memory is bounded: at most MaxMessages messages are tracked at once,
// each for at most two windows; lines of messages past that share one
// budget of Burst lines per Window.
package loglimit

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// The defaults of Config.
const (
	DefaultBurst       = 20
	DefaultWindow      = 10 * time.Second
	DefaultMaxMessages = 256
)

// Config sets the limits; a zero field takes its default.
type Config struct {
	// Burst is how many lines of one message pass per Window. Default 20.
	Burst int
	// Window is the period Burst counts over. Default 10s.
	Window time.Duration
	// MaxMessages bounds the messages tracked at once. Default 256.
	MaxMessages int
}

// SuppressedMsg is the message of the line that reports lines left out
// when no later line of their message came to carry the count.
const SuppressedMsg = "log lines suppressed"

// otherMessages names, in a summary, the lines of the messages past
// MaxMessages, which share one budget.
const otherMessages = "(messages past the tracking limit)"

// Handler limits the warnings and errors it hands to the handler it wraps.
type Handler struct {
	next slog.Handler
	st   *state // shared by the handlers WithAttrs and WithGroup derive
}

// New returns next limited by c.
func New(next slog.Handler, c Config) *Handler {
	if c.Burst <= 0 {
		c.Burst = DefaultBurst
	}
	if c.Window <= 0 {
		c.Window = DefaultWindow
	}
	if c.MaxMessages <= 0 {
		c.MaxMessages = DefaultMaxMessages
	}
	return &Handler{next: next, st: &state{cfg: c, root: next, msgs: map[string]*entry{}}}
}

// Suppressed returns how many lines have been left out so far.
func (h *Handler) Suppressed() int64 { return h.st.suppressed.Load() }

// Flush writes a summary line for every message with lines left out that
// no line has said yet, as if its window had ended now: a process that
// stops right after a flood, or falls quiet, still says what it left out.
func (h *Handler) Flush(ctx context.Context) {
	now := time.Now()
	h.st.mu.Lock()
	var summaries []slog.Record
	for _, e := range h.st.msgs {
		if e.dropped > 0 {
			summaries = append(summaries, h.st.summary(e, now))
			e.dropped = 0
		}
	}
	if h.st.other.dropped > 0 {
		summaries = append(summaries, h.st.summary(&h.st.other, now))
		h.st.other.dropped = 0
	}
	h.st.mu.Unlock()
	for _, s := range summaries {
		if h.st.root.Enabled(ctx, s.Level) {
			_ = h.st.root.Handle(ctx, s)
		}
	}
}

// Enabled implements slog.Handler.
func (h *Handler) Enabled(ctx context.Context, l slog.Level) bool { return h.next.Enabled(ctx, l) }

// WithAttrs implements slog.Handler. The limits are the same: a message
// is one message whatever logger says it.
func (h *Handler) WithAttrs(as []slog.Attr) slog.Handler {
	return &Handler{next: h.next.WithAttrs(as), st: h.st}
}

// WithGroup implements slog.Handler.
func (h *Handler) WithGroup(name string) slog.Handler {
	return &Handler{next: h.next.WithGroup(name), st: h.st}
}

// Handle implements slog.Handler.
func (h *Handler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < slog.LevelWarn {
		return h.next.Handle(ctx, r)
	}
	now := r.Time
	if now.IsZero() {
		now = time.Now()
	}
	keep, carried, summaries := h.st.admit(r.Message, r.Level, now)
	// Summaries go to the handler New wrapped: they are about the
	// process's log, not about the logger that happened to trigger them.
	for _, s := range summaries {
		// The level may have been raised since the lines were left out.
		if h.st.root.Enabled(ctx, s.Level) {
			_ = h.st.root.Handle(ctx, s)
		}
	}
	if !keep {
		return nil
	}
	if carried > 0 {
		// The caller's record may share its attributes with copies.
		r = r.Clone()
		r.AddAttrs(slog.Int("suppressed", carried))
	}
	return h.next.Handle(ctx, r)
}

// state is the count of every message, shared by a Handler and those it
// derives.
type state struct {
	cfg        Config
	root       slog.Handler
	suppressed atomic.Int64

	mu      sync.Mutex        // guards the fields below
	msgs    map[string]*entry // by key(message)
	other   entry             // the messages past cfg.MaxMessages
	sweepAt time.Time         // when entries whose window ended are next dropped
}

// entry counts one message's lines in its current window.
type entry struct {
	msg     string     // the first message seen under its key, for summaries
	level   slog.Level // that line's level, for its summary
	start   time.Time  // the window's start
	n       int        // lines passed in the window
	dropped int        // lines left out in the window
}

// admit counts a line of msg at now. keep says whether it goes out;
// carried is how many lines of msg the previous window left out, for this
// line to say; summaries report the windows that ended with lines left
// out and no line to carry their count.
func (st *state) admit(msg string, level slog.Level, now time.Time) (keep bool, carried int, summaries []slog.Record) {
	k := key(msg)
	st.mu.Lock()
	defer st.mu.Unlock()
	e := st.msgs[k]
	if e != nil && now.Sub(e.start) >= st.cfg.Window {
		// Before the sweep, which would report the count apart: the
		// line of the message itself says it best.
		carried = e.dropped
		e.start, e.n, e.dropped = now, 0, 0
	}
	if !now.Before(st.sweepAt) {
		summaries = st.sweepLocked(now)
		st.sweepAt = now.Add(st.cfg.Window)
	}
	if e == nil {
		if len(st.msgs) < st.cfg.MaxMessages {
			e = &entry{msg: msg, level: level, start: now}
			st.msgs[k] = e
		} else {
			e = &st.other
			if e.start.IsZero() {
				*e = entry{msg: otherMessages, level: level, start: now}
			}
		}
	}
	if e == &st.other && now.Sub(e.start) >= st.cfg.Window {
		// Other messages' count: said apart, not by this line.
		if e.dropped > 0 {
			summaries = append(summaries, st.summary(e, now))
		}
		e.start, e.n, e.dropped = now, 0, 0
	}
	if e.n < st.cfg.Burst {
		e.n++
		return true, carried, summaries
	}
	e.dropped++
	st.suppressed.Add(1)
	return false, 0, summaries
}

// sweepLocked forgets the entries whose window has ended, and returns a
// summary for each that left lines out: it keeps the map to the messages
// of the last two windows. Caller holds st.mu.
func (st *state) sweepLocked(now time.Time) []slog.Record {
	var out []slog.Record
	for k, e := range st.msgs {
		if now.Sub(e.start) < st.cfg.Window {
			continue
		}
		if e.dropped > 0 {
			out = append(out, st.summary(e, now))
		}
		delete(st.msgs, k)
	}
	if !st.other.start.IsZero() && now.Sub(st.other.start) >= st.cfg.Window {
		if st.other.dropped > 0 {
			out = append(out, st.summary(&st.other, now))
		}
		st.other = entry{}
	}
	return out
}

// summary is the line that says e's window left lines out.
func (st *state) summary(e *entry, now time.Time) slog.Record {
	r := slog.NewRecord(now, e.level, SuppressedMsg, 0)
	r.AddAttrs(slog.String("message", e.msg), slog.Int("suppressed", e.dropped),
		slog.Duration("window", st.cfg.Window), slog.Int("limit", st.cfg.Burst))
	return r
}

// key is what makes two lines one message: msg with every run of hex
// digits, ':', '.', '[' and ']' that holds a decimal digit replaced by
// '#'. Lines of libraries that print their details into the message
// ("http: TLS handshake error from 192.0.2.1:55012: EOF") then count as
// the one message they are, not one per client port.
func key(msg string) string {
	digit := false
	for i := 0; i < len(msg); i++ {
		if msg[i] >= '0' && msg[i] <= '9' {
			digit = true
			break
		}
	}
	if !digit {
		return msg // the usual message: a constant
	}
	b := make([]byte, 0, len(msg))
	for i := 0; i < len(msg); {
		j, hasDigit := i, false
		for j < len(msg) && numeric(msg[j]) {
			hasDigit = hasDigit || msg[j] >= '0' && msg[j] <= '9'
			j++
		}
		switch {
		case j == i:
			b = append(b, msg[i])
			i++
		case hasDigit:
			b = append(b, '#')
			i = j
		default:
			b = append(b, msg[i:j]...)
			i = j
		}
	}
	return string(b)
}

func numeric(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F' ||
		c == ':' || c == '.' || c == '[' || c == ']'
}

// Interface guard.
var _ slog.Handler = (*Handler)(nil)
