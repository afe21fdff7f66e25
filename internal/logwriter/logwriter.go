// Package logwriter batches log lines into fewer writes.
//
// With the access log on, every request is a line, and a write(2) per line
// is a measurable share of a miss's CPU. A Writer collects lines for a
// short delay (or until its buffer fills) and writes them at once. Lines
// reach the output late by at most that delay; Close writes what is left.
// bufio.Writer alone would hold a quiet process's last lines for ever, and
// is not safe for the goroutines that log at once.
//
// The output is written on a goroutine of the Writer's, never on the one
// that logs: an output that stalls (a pipe nobody drains, a stuck log
// shipper, a terminal on hold) must not stall the requests that log. While
// it has not taken a batch, lines wait, up to backlog batches' worth; what
// does not fit is dropped and counted (Dropped), so memory stays bounded.
package logwriter

import (
	"io"
	"sync"
	"sync/atomic"
	"time"
)

// backlog is how many batches' worth of lines may wait while the output
// is still writing one: room for a scheduling hiccup of the goroutine that
// writes, not for an output slower than the logging.
const backlog = 16

// Writer is an io.Writer that batches what is written to it.
type Writer struct {
	w     io.Writer
	max   int
	delay time.Duration

	dropped atomic.Int64 // lines dropped while the output was behind

	mu      sync.Mutex // guards the fields below
	done    sync.Cond  // on mu: a batch's write to w ended
	buf     []byte     // lines waiting
	spare   []byte     // the other buffer, while no batch is being written
	writing bool       // a goroutine is writing a batch to w: the only writer of w
	armed   bool       // the timer will send buf
	closed  bool
	timer   *time.Timer
}

// New returns a Writer that writes to w at the latest delay after a line,
// or once size bytes are waiting.
func New(w io.Writer, size int, delay time.Duration) *Writer {
	b := &Writer{w: w, max: size, delay: delay, buf: make([]byte, 0, size), spare: make([]byte, 0, size)}
	b.done.L = &b.mu
	b.timer = time.AfterFunc(time.Hour, b.send)
	b.timer.Stop()
	return b
}

// Write keeps a copy of p for the next batch. It never fails and never
// waits for the output: a log output that fails or stalls loses lines,
// not requests. A line that does not fit the backlog while the output is
// still busy with a batch is dropped (see Dropped).
func (b *Writer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		// The process is ending: straight through, after what waits.
		b.flushLocked()
		b.w.Write(p)
		return len(p), nil
	}
	if len(b.buf)+len(p) > b.max {
		b.startLocked()
		if len(b.buf) > 0 && len(b.buf)+len(p) > backlog*b.max {
			b.dropped.Add(1)
			return len(p), nil
		}
		// With nothing waiting, p is kept whatever its size: one line
		// at most beyond the bound.
	}
	b.buf = append(b.buf, p...)
	if len(b.buf) >= b.max {
		b.startLocked()
	} else if !b.armed {
		b.armed = true
		b.timer.Reset(b.delay)
	}
	return len(p), nil
}

// Dropped returns the number of lines dropped because the output had not
// taken what was already waiting.
func (b *Writer) Dropped() int64 { return b.dropped.Load() }

// send is the timer's: it hands what waits to the output.
func (b *Writer) send() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.armed = false
	b.startLocked()
}

// startLocked hands buf to a goroutine that writes it to the output,
// unless one still is (it goes on with buf when done). Caller holds mu.
func (b *Writer) startLocked() {
	if b.writing || len(b.buf) == 0 {
		return
	}
	b.armed = false
	b.timer.Stop()
	batch := b.buf
	b.buf, b.spare = b.spare, nil
	b.writing = true
	go b.write(batch)
}

// write writes batch to the output, then what has filled up meanwhile,
// unless the timer is due to send it (a batch that fills the buffer is
// not held back for it).
func (b *Writer) write(batch []byte) {
	for {
		b.w.Write(batch)
		b.mu.Lock()
		batch = batch[:0]
		if cap(batch) > backlog*b.max {
			batch = make([]byte, 0, b.max) // grown by a long line: not kept
		}
		if len(b.buf) == 0 || b.armed && len(b.buf) < b.max {
			b.spare = batch
			b.writing = false
			b.done.Broadcast()
			b.mu.Unlock()
			return
		}
		b.armed = false
		b.timer.Stop()
		batch, b.buf = b.buf, batch
		b.mu.Unlock()
	}
}

// Flush writes what is waiting, and returns once the output has taken
// it: unlike Write, it waits for a slow output.
func (b *Writer) Flush() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.flushLocked()
}

// flushLocked waits for a batch being written, then writes buf on the
// caller's goroutine. Caller holds mu.
func (b *Writer) flushLocked() {
	b.armed = false
	b.timer.Stop()
	for b.writing {
		b.done.Wait()
	}
	if len(b.buf) > 0 {
		b.w.Write(b.buf)
		b.buf = b.buf[:0]
	}
}

// Close writes what is waiting and stops the timer; later writes go
// straight through.
func (b *Writer) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	b.flushLocked()
	return nil
}
