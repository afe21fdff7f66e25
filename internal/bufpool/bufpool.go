// Package bufpool lends the 32 KiB buffers that copy bodies: an origin's
// into a flight's spool, a spool's to a client. Each request used to
// allocate two of them, most of the bytes the miss path allocates, and so
// most of the garbage collector's work.
package bufpool

import "sync"

// Size is the length of every buffer: io.Copy's own.
const Size = 32 << 10

var pool = sync.Pool{New: func() any { b := make([]byte, Size); return &b }}

// Get returns a buffer of Size bytes. Give it back with Put once nothing
// refers to it any more.
func Get() *[]byte { return pool.Get().(*[]byte) }

// Put returns b to the pool.
func Put(b *[]byte) {
	if cap(*b) >= Size {
		*b = (*b)[:Size]
		pool.Put(b)
	}
}
