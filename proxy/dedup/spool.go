package dedup

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
)

// A spool holds one flight's response body while it arrives: one writer
// (the flight's download) appends the origin's bytes, and any number of
// readers follow it, each from any offset at its own pace. A reader that
// catches up with the writer waits for the next bytes; one that lags reads
// what is already there. Nobody waits for anybody else: the download runs
// at the origin's speed, the fastest reader right behind it, the slowest
// as slow as it likes.
//
// The bytes live in memory up to a bound (max_body_bytes for one spool,
// spool_memory_bytes for all of them together), then in a file in the
// spool directory: the memory part is written to the file and dropped, and
// everything after goes to the file (all files together within
// spool_disk_bytes; past it a write fails as on a full disk). The file is
// removed, and the memory returned, when the last holder lets go.
//
// A body of unknown length that grows past max_object_bytes switches the
// spool to relay mode (see startRelay): from then on it keeps only the
// chunk being passed on.
type spool struct {
	pool   *spools
	memMax int64 // this spool's memory bound

	mu       sync.Mutex // protects everything below
	mem      []byte     // the body while in memory (nil once in a file)
	reserved int64      // bytes of pool.budget held for mem's capacity
	file     *os.File   // the body once spilled; nil before
	onDisk   int64      // bytes of pool.diskBudget held for file
	n        int64      // bytes readers may read: below n
	hidden   int64      // bytes written after n, shown by finish (writeLast)
	done     bool       // the writer finished (err says how)
	err      error      // the download failed: every reader gets it after the bytes that came
	wake     chan struct{}
	refs     int // holders: the flight, and every open reader
	// Relay mode: only [base, n) is kept, and the writer waits until every
	// reader has read it before appending more.
	relay    bool
	base     int64
	readers  map[*spoolReader]struct{}
	progress chan struct{} // closed and replaced when a reader comes, advances or leaves (relay mode)
	// interest counts the requests that will read (relay mode): a request
	// that joined the flight may not have opened its reader yet, and the
	// bytes it needs must not go before it has. Set by the download.
	interest func() int
}

// spools is what every spool of one engine shares: the directory for
// files and the memory budget.
type spools struct {
	dir    *runDir
	budget int64 // spool_memory_bytes
	used   atomic.Int64
	active atomic.Int64 // spools alive
	files  atomic.Int64 // spools that spilled to a file and still hold it
	// diskBudget (spool_disk_bytes) bounds what the files hold together;
	// diskUsed is what they hold.
	diskBudget int64
	diskUsed   atomic.Int64
}

func (p *spools) reserve(n int64) bool {
	if p.used.Add(n) > p.budget {
		p.used.Add(-n)
		return false
	}
	return true
}

func (p *spools) release(n int64) { p.used.Add(-n) }

// reserveDisk is reserve for the files: spool_disk_bytes.
func (p *spools) reserveDisk(n int64) bool {
	if p.diskUsed.Add(n) > p.diskBudget {
		p.diskUsed.Add(-n)
		return false
	}
	return true
}

// newSpool returns a spool held once (by the flight). size is the declared
// length (-1 unknown): a body known to be larger than the memory bound
// goes to a file from its first byte, one known to fit gets its buffer at
// once.
func (p *spools) newSpool(memMax, size int64) *spool {
	s := &spool{pool: p, memMax: memMax, wake: make(chan struct{}), refs: 1}
	p.active.Add(1)
	if size > memMax {
		s.memMax = 0
	} else if size > 0 && p.reserve(size) {
		s.mem, s.reserved = make([]byte, 0, size), size
	}
	return s
}

var (
	errNoReaders = errors.New("nobody reads this body any more")
	// errSpoolDiskFull is a spool file that would grow past
	// spool_disk_bytes: it fails the write as a full disk does.
	errSpoolDiskFull = errors.New("spool files at dedup.spool_disk_bytes")
	errRelayed       = errors.New("body is relayed past max_object_bytes: its start is gone")
)

// fileError is a spool file that could not be made or written (disk full,
// the directory unwritable): the bytes written so far are still readable,
// and the writer may go on in relay mode (see download.copy).
type fileError struct{ err error }

func (e fileError) Error() string { return "spool: " + e.err.Error() }
func (e fileError) Unwrap() error { return e.err }

// write appends p, waking the readers. In relay mode it first waits until
// every reader has read what came before (ctx bounds the wait). Only the
// writer calls it.
func (s *spool) write(ctx context.Context, p []byte) error { return s.append(ctx, p, false) }

// writeLast appends the body's last bytes without showing them: readers
// get them with the end, from finish. A client that knows the length is
// done at its last byte; by then the body must be in the cache, or the
// client's next request would not find it there.
func (s *spool) writeLast(ctx context.Context, p []byte) error { return s.append(ctx, p, true) }

func (s *spool) append(ctx context.Context, p []byte, hide bool) error {
	s.mu.Lock()
	if s.relay {
		return s.relayLocked(ctx, p) // unlocks
	}
	if s.file == nil {
		if s.growLocked(len(p)) {
			s.mem = append(s.mem, p...)
			s.advanceLocked(len(p), hide)
			s.mu.Unlock()
			return nil
		}
		s.mu.Unlock()
		if err := s.spill(); err != nil {
			return err
		}
	} else {
		s.mu.Unlock()
	}
	// In a file: the writer appends, readers ReadAt below n. Bytes of p
	// that a failed Write left past n are never read, but stay counted
	// until the file goes.
	if err := s.holdDisk(int64(len(p))); err != nil {
		return err
	}
	if _, err := s.file.Write(p); err != nil {
		return fileError{err}
	}
	s.mu.Lock()
	s.advanceLocked(len(p), hide)
	s.mu.Unlock()
	return nil
}

func (s *spool) advanceLocked(k int, hide bool) {
	if hide {
		s.hidden += int64(k)
		return
	}
	s.n += int64(k)
	s.broadcastLocked()
}

// growLocked makes room in mem for k more bytes, within the spool's bound
// and the shared budget. false: the body goes to a file.
func (s *spool) growLocked(k int) bool {
	need := int64(len(s.mem) + k) // len(mem) is n + hidden
	if need <= int64(cap(s.mem)) {
		return true
	}
	if need > s.memMax {
		return false
	}
	newCap := min(max(2*int64(cap(s.mem)), need, 16<<10), s.memMax)
	if !s.pool.reserve(newCap - s.reserved) {
		return false
	}
	grown := make([]byte, len(s.mem), newCap)
	copy(grown, s.mem)
	s.mem, s.reserved = grown, newCap
	return true
}

// holdDisk reserves k bytes of spool_disk_bytes for the file. Only the
// writer calls it.
func (s *spool) holdDisk(k int64) error {
	if !s.pool.reserveDisk(k) {
		return fileError{errSpoolDiskFull}
	}
	s.mu.Lock()
	s.onDisk += k
	s.mu.Unlock()
	return nil
}

// dropDiskLocked gives back what the file held of spool_disk_bytes, as it
// goes.
func (s *spool) dropDiskLocked() {
	s.pool.diskUsed.Add(-s.onDisk)
	s.onDisk = 0
}

// spill moves the body to a file. Readers keep reading mem until the
// switch, which happens under the lock once the file holds every byte.
func (s *spool) spill() error {
	s.mu.Lock()
	mem := s.mem
	s.mu.Unlock()
	if !s.pool.reserveDisk(int64(len(mem))) {
		return fileError{errSpoolDiskFull}
	}
	f, err := s.pool.dir.create("spool-*")
	if err != nil {
		s.pool.diskUsed.Add(-int64(len(mem)))
		return fileError{err}
	}
	// What mem holds never changes, and only the writer (us) appends.
	if _, err := f.Write(mem); err != nil {
		f.Close()
		os.Remove(f.Name())
		s.pool.diskUsed.Add(-int64(len(mem)))
		return fileError{err}
	}
	s.mu.Lock()
	s.file, s.mem, s.onDisk = f, nil, int64(len(mem))
	s.pool.release(s.reserved)
	s.reserved = 0
	s.mu.Unlock()
	s.pool.files.Add(1)
	return nil
}

// startRelay switches the spool to relay mode: a body of unknown length
// grew past max_object_bytes, so it cannot be kept (nor cached). The bytes
// already spooled stay readable; after them, the writer passes each chunk
// on only once every reader has taken the previous one, so the spool holds
// one chunk and the download goes at the pace of its slowest reader (what
// Squid does for objects it will not cache, with read_ahead_gap). No
// reader can join any more: the flight has left the registry.
func (s *spool) startRelay() {
	s.mu.Lock()
	s.relay = true
	s.progress = make(chan struct{})
	// Wake those waiting in length: they must let go (see there).
	s.broadcastLocked()
	s.mu.Unlock()
}

// poke wakes a relay waiting for readers: one may have left before
// opening its reader.
func (s *spool) poke() {
	s.mu.Lock()
	s.progressLocked()
	s.mu.Unlock()
}

func (s *spool) relaying() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.relay
}

// relayLocked is write in relay mode; s.mu is held and released.
func (s *spool) relayLocked(ctx context.Context, p []byte) error {
	for {
		want := s.interest()
		if want == 0 {
			s.mu.Unlock()
			return errNoReaders
		}
		caughtUp := len(s.readers) >= want
		for r := range s.readers {
			if !caughtUp || r.off < s.n {
				caughtUp = false
				break
			}
		}
		if caughtUp {
			break
		}
		ch := s.progress
		s.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
		s.mu.Lock()
	}
	// Everyone has read everything: drop it and keep only p.
	if s.file != nil {
		s.file.Close()
		os.Remove(s.file.Name())
		s.file = nil
		s.pool.files.Add(-1)
		s.dropDiskLocked()
	}
	s.pool.release(s.reserved)
	s.reserved = 0
	s.base = s.n
	s.mem = append(s.mem[:0:0], p...)
	s.n += int64(len(p))
	s.broadcastLocked()
	s.mu.Unlock()
	return nil
}

// finish ends writing: err nil means the body is complete; otherwise every
// reader gets err once it has read the bytes that came.
func (s *spool) finish(err error) {
	s.mu.Lock()
	s.n += s.hidden
	s.hidden = 0
	s.done, s.err = true, err
	s.broadcastLocked()
	s.mu.Unlock()
}

func (s *spool) broadcastLocked() {
	close(s.wake)
	s.wake = make(chan struct{})
}

// progressLocked wakes a relay's writer waiting for its readers to move.
func (s *spool) progressLocked() {
	if s.relay {
		close(s.progress)
		s.progress = make(chan struct{})
	}
}

// The writer, once the body is complete (before finish, so that the body
// is cached before its readers see the end, unless it goes to the fleet:
// see download.run), takes it with written and bytes or filePath.

// complete reports whether the whole body arrived and its readers may
// read it to the end.
func (s *spool) complete() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.done && s.err == nil
}

func (s *spool) written() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n + s.hidden
}

// bytes returns the body when it is all in memory.
func (s *spool) bytes() ([]byte, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.file != nil || s.relay {
		return nil, false
	}
	if spare := cap(s.mem) - len(s.mem); spare > len(s.mem)/4 {
		// A Store weighs an entry by its length: do not let it keep up
		// to twice that alive (a body of unknown length grew by doubling).
		return bytes.Clone(s.mem), true
	}
	return s.mem[:len(s.mem):len(s.mem)], true
}

// readBack returns a body that was spilled to its file, read back into
// memory, when it is at most limit bytes. The writer must be done with it
// (its readers need not be: ReadAt leaves their offsets alone).
func (s *spool) readBack(limit int64) ([]byte, bool) {
	s.mu.Lock()
	f, n := s.file, s.n+s.hidden
	ok := f != nil && !s.relay && n <= limit
	s.mu.Unlock()
	if !ok {
		return nil, false
	}
	b := make([]byte, n)
	if m, _ := f.ReadAt(b, 0); int64(m) != n {
		return nil, false
	}
	return b, true
}

// filePath returns the file of a body that was spilled, for the disk
// tier to link; it stays valid while the spool is held.
func (s *spool) filePath() (string, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.file == nil || s.relay {
		return "", false
	}
	return s.file.Name(), true
}

// length returns the body's length, waiting for the end of the download
// when it is not known yet. A relayed body fails it with errRelayed: the
// relay waits for every request on the flight to read, and one waiting
// here reads nothing before the end, so it would hold the relay (and every
// reader) until its client gave up; the bytes it wants are going anyway.
func (s *spool) length(ctx context.Context) (int64, error) {
	s.mu.Lock()
	for !s.done {
		if s.relay {
			s.mu.Unlock()
			return 0, errRelayed
		}
		ch := s.wake
		s.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return 0, context.Cause(ctx)
		}
		s.mu.Lock()
	}
	n, err := s.n, s.err
	s.mu.Unlock()
	return n, err
}

// hold adds a holder; release drops one. The last release removes the
// file and returns the memory.
func (s *spool) hold() {
	s.mu.Lock()
	s.refs++
	s.mu.Unlock()
}

func (s *spool) release() {
	s.mu.Lock()
	s.refs--
	if s.refs > 0 {
		s.mu.Unlock()
		return
	}
	f, reserved := s.file, s.reserved
	s.file, s.mem, s.reserved = nil, nil, 0
	s.dropDiskLocked()
	s.mu.Unlock()
	if f != nil {
		f.Close()
		os.Remove(f.Name())
		s.pool.files.Add(-1)
	}
	s.pool.release(reserved)
	s.pool.active.Add(-1)
}

// reader returns a reader of the body from off, holding the spool until
// it is closed. ctx is the reading client's: a reader waiting for bytes
// gives up when its client does. onClose runs once, after Close.
func (s *spool) reader(ctx context.Context, off int64, onClose func()) (*spoolReader, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.relay && off < s.base {
		return nil, errRelayed
	}
	s.refs++
	r := &spoolReader{s: s, ctx: ctx, off: off, onClose: onClose}
	if s.readers == nil {
		s.readers = make(map[*spoolReader]struct{})
	}
	s.readers[r] = struct{}{}
	s.progressLocked()
	return r, nil
}

// spoolReader is one client's reader of a spool.
type spoolReader struct {
	s       *spool
	ctx     context.Context
	off     int64 // next byte to read; guarded by s.mu
	once    sync.Once
	onClose func()
}

func (r *spoolReader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	s := r.s
	s.mu.Lock()
	for {
		if _, open := s.readers[r]; !open {
			s.mu.Unlock()
			return 0, os.ErrClosed
		}
		if r.off < s.n {
			break
		}
		if s.done {
			err := s.err
			s.mu.Unlock()
			if err == nil {
				return 0, io.EOF
			}
			return 0, err
		}
		ch := s.wake
		s.mu.Unlock()
		select {
		case <-ch:
		case <-r.ctx.Done():
			return 0, context.Cause(r.ctx)
		}
		s.mu.Lock()
	}
	avail := s.n - r.off
	if int64(len(p)) > avail {
		p = p[:avail]
	}
	if s.file == nil {
		n := copy(p, s.mem[r.off-s.base:])
		r.advanceLocked(n)
		s.mu.Unlock()
		return n, nil
	}
	// The file holds every byte below n; reading it needs no lock, and
	// the file stays open while this reader holds the spool.
	f, off := s.file, r.off
	s.mu.Unlock()
	n, err := f.ReadAt(p, off)
	if n > 0 {
		s.mu.Lock()
		r.advanceLocked(n)
		s.mu.Unlock()
		return n, nil
	}
	if err == nil || err == io.EOF {
		err = io.ErrUnexpectedEOF // below n the file has the bytes
	}
	return 0, fmt.Errorf("spool: %w", err)
}

func (r *spoolReader) advanceLocked(n int) {
	r.off += int64(n)
	r.s.progressLocked()
}

// Close lets go of the spool.
func (r *spoolReader) Close() error {
	r.once.Do(func() {
		s := r.s
		s.mu.Lock()
		delete(s.readers, r)
		s.progressLocked()
		s.mu.Unlock()
		s.release()
		if r.onClose != nil {
			r.onClose()
		}
	})
	return nil
}
