// Package logwriter batches log lines into fewer writes.
//
// With the access log on, every request is a line, and a write(2) per line
// is a measurable share of a miss's CPU. A Writer collects lines for a
// short delay (or until its buffer fills) and writes them at once. Lines
// reach the output late by at most that delay; Close writes what is left.
// bufio.Writer alone would hold a quiet process's last lines for ever, and
// is not safe for the goroutines that log at once.
package logwriter

import (
	"io"
	"sync"
	"time"
)

// Writer is an io.Writer that batches what is written to it.
type Writer struct {
	w     io.Writer
	max   int
	delay time.Duration

	mu     sync.Mutex // guards the fields below, and writes to w
	buf    []byte
	armed  bool // the timer will flush buf
	closed bool
	timer  *time.Timer
}

// New returns a Writer that writes to w at the latest delay after a line,
// or once size bytes are waiting.
func New(w io.Writer, size int, delay time.Duration) *Writer {
	b := &Writer{w: w, max: size, delay: delay, buf: make([]byte, 0, size)}
	b.timer = time.AfterFunc(time.Hour, b.Flush)
	b.timer.Stop()
	return b
}

// Write keeps a copy of p for the next flush. It never fails: a log
// output that fails loses lines, not requests.
func (b *Writer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed || len(p) >= b.max {
		b.flushLocked()
		b.w.Write(p)
		return len(p), nil
	}
	if len(b.buf)+len(p) > b.max {
		b.flushLocked()
	}
	b.buf = append(b.buf, p...)
	if !b.armed {
		b.armed = true
		b.timer.Reset(b.delay)
	}
	return len(p), nil
}

// Flush writes what is waiting.
func (b *Writer) Flush() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.flushLocked()
}

func (b *Writer) flushLocked() {
	b.armed = false
	if len(b.buf) == 0 {
		return
	}
	b.w.Write(b.buf)
	b.buf = b.buf[:0]
}

// Close writes what is waiting and stops the timer; later writes go
// straight through.
func (b *Writer) Close() error {
	b.timer.Stop()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.flushLocked()
	b.closed = true
	return nil
}
