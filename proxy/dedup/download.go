package dedup

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/bufpool"
)

// download is the second half of a flight: it copies the origin's body
// into the flight's spool, where every reader follows it, then keeps the
// body (Store or disk tier) and tells the fleet. It runs in the flight's
// goroutine, detached from every client: readers come and go, and the
// download goes on as long as somebody reads or the body is to be kept.
type download struct {
	e       *Engine
	key     string
	obj     *object
	body    io.ReadCloser // the origin's
	ttl     time.Duration
	ctx     context.Context // the flight's: ends with the engine, a stall, or nobody left
	cancel  context.CancelCauseFunc
	release func() // ends ctx's timers
	slots   func() // gives back the flight's max_flights slots
	lease   Lease  // nil: no fleet, or the fleet was already told
	// limit is the size past which the body cannot go through the shared
	// store (see shareLimit); streamed: the lease was kept, and the
	// fleet's waiters read the body from this instance's peer listener.
	limit    int64
	streamed bool
}

// stallError ends a download whose origin sent nothing for stall_timeout:
// a timeout (504) for the clients of a body read whole before its head
// goes out (see smallBodyBytes), as timeoutError is.
type stallError struct{ d time.Duration }

func (e stallError) Error() string {
	return "upstream body stalled: no byte for dedup.stall_timeout (" + e.d.String() + ")"
}
func (stallError) Timeout() bool   { return true }
func (stallError) Temporary() bool { return true }

func (e *Engine) newDownload(key string, resp *http.Response, meta *Entry, ttl time.Duration,
	ctx context.Context, cancel context.CancelCauseFunc, release, slots func(), lease Lease) (*object, *download) {
	size := resp.ContentLength
	obj := &object{meta: meta, size: size, cancel: cancel}
	obj.body = e.spools.newSpool(int64(e.cfg.MaxBodyBytes), size)
	// The writer's own hold, besides the flight's: the flight may let go
	// (nobody left) while the download still ends its work on the spool.
	obj.body.hold()
	obj.keep = ttl > 0 && e.canKeep(size)
	d := &download{e: e, key: key, obj: obj, body: resp.Body, ttl: ttl,
		ctx: ctx, cancel: cancel, release: release, slots: slots, lease: lease}
	d.limit = d.shareLimit()
	obj.owed = lease != nil
	if size > d.limit {
		// The fleet's waiters need not wait for the end of a long
		// download to learn that it will not come through the store.
		d.tooBig()
	}
	return obj, d
}

// shareLimit is the body size past which the lease cannot share the body
// through the store: max_body_bytes and the Store's own limit, or, for a
// lease that can send its waiters here instead, the store's value limit.
func (d *download) shareLimit() int64 {
	limit := d.e.wholeLimit
	if sl, ok := d.lease.(StreamingLease); ok {
		if above := sl.StreamAbove(); above > 0 {
			limit = min(limit, above)
		}
	}
	return limit
}

// tooBig tells the fleet that the body will not come through the store:
// its waiters read it from here, keeping the lease until the end of the
// download (a StreamingLease), or fetch their own.
func (d *download) tooBig() {
	if d.lease == nil || d.streamed {
		return
	}
	// Either way the fleet's waiters no longer wait for the end: those
	// that read it from here are readers like any other.
	d.e.flights.mu.Lock()
	d.obj.owed = false
	d.e.flights.mu.Unlock()
	if sl, ok := d.lease.(StreamingLease); ok && sl.StreamAbove() > 0 {
		ctx, cancel := context.WithTimeout(d.e.base, 5*time.Second)
		err := sl.Stream(ctx)
		cancel()
		if err == nil {
			d.streamed = true
			return
		}
		d.e.log.Warn("could not offer a big body to the fleet from this instance; the others fetch their own", "key", d.key, "err", err)
	}
	d.e.finishLease(d.e.base, d.lease, d.key, TooLarge(nil), 0)
	d.lease = nil
}

// canKeep reports whether a body of this declared size (-1 unknown) could
// be cached when complete.
func (e *Engine) canKeep(size int64) bool {
	if size <= e.wholeLimit {
		return true // in the Store; unknown: we will see
	}
	return e.disk != nil && size <= e.disk.max
}

// run downloads the body, then keeps or drops it. The flight leaves the
// registry once the body is in the cache: a request that missed the cache
// until then found the flight instead.
func (d *download) run(f *flight) {
	defer d.slots()
	defer d.release()
	defer d.obj.body.release()
	defer func() {
		if p := recover(); p != nil {
			// The spool's readers must not wait for ever, nor the
			// fleet's for the lease.
			d.e.log.Error("panic in a download; recovered", "key", d.key, "panic", p, "stack", string(debug.Stack()))
			d.e.flights.unlist(f)
			d.obj.body.finish(fmt.Errorf("internal error in flight: %v", p))
			if d.lease != nil {
				d.lease.Release()
			}
		}
	}()
	d.obj.body.interest = func() int { return d.e.flights.interestIn(f) }
	err := d.copy(f)
	if err != nil {
		d.e.flights.unlist(f)
		d.obj.body.finish(err)
		if d.lease != nil {
			d.e.finishLease(d.e.base, d.lease, d.key, Outcome{Err: err.Error(), Timeout: isTimeoutErr(err)}, 0)
		}
		return
	}
	body, whole := d.wholeBody()
	if d.toFleet(whole) {
		// The fleet's store is a round trip away, and the readers need
		// not wait for it (see endLease): they see the end first, and the
		// flight stays listed until the store has the body, so that a
		// request meanwhile reads it whole from the spool (settled).
		d.e.sharingBegins()
		defer d.e.sharingEnds(f)
		d.obj.body.finish(nil)
		d.keep(body, whole)
		return
	}
	// Cached before the readers see the end: a client that read the whole
	// body and asks again finds it in the cache.
	d.keep(body, whole)
	d.e.flights.unlist(f)
	d.obj.body.finish(nil)
}

// toFleet reports whether keep hands the complete body to the fleet's
// store with the lease, to cache: whole (see wholeBody), not expired.
func (d *download) toFleet(whole bool) bool {
	return d.lease != nil && whole && time.Now().Before(d.obj.meta.ExpiresAt) && d.keeping()
}

// wholeBody returns the complete body, and whether it is to be kept whole
// in the Store (at most max_body_bytes). That is the spool's memory, or
// its file read back: a body of any size spills to a file when the spools'
// shared memory (spool_memory_bytes) runs out while it comes, and a
// body the Store could hold was then kept only in the disk tier, and
// never shared with the fleet. nil when it is in a file and too big.
func (d *download) wholeBody() ([]byte, bool) {
	if body, ok := d.obj.body.bytes(); ok {
		return body, d.obj.body.written() <= d.e.wholeLimit
	}
	return d.obj.body.readBack(d.e.wholeLimit)
}

// copy reads the origin's body into the spool. Its error says why the body
// is incomplete; every reader gets it.
func (d *download) copy(f *flight) error {
	defer d.body.Close()
	idle := d.e.cfg.StallTimeout
	// The stall timer runs only while waiting for the origin, never while
	// a write waits for the readers (relay mode).
	stall := time.AfterFunc(idle, func() { d.cancel(stallError{idle}) })
	defer stall.Stop()
	// The spool copies what it is given (write), so the buffer goes back
	// to the pool when the copy ends.
	bp := bufpool.Get()
	defer bufpool.Put(bp)
	buf := *bp
	limit := int64(d.e.cfg.MaxObjectBytes)
	var n int64
	for {
		k, rerr := d.body.Read(buf)
		stall.Stop()
		if k > 0 {
			n += int64(k)
			if d.obj.size >= 0 && n > d.obj.size {
				// The transports below enforce Content-Length; this is
				// the engine's own guard, for any Next that does not:
				// past its declared end a body is not the one cached.
				return d.why(fmt.Errorf("read upstream body: %d bytes past its Content-Length of %d", n-d.obj.size, d.obj.size))
			}
			if n > limit && !d.obj.body.relaying() {
				// Only a body of unknown length gets here: a declared
				// one over the limit was not spooled.
				d.e.flights.drop(f)
				d.obj.body.startRelay()
			}
			write := d.obj.body.write
			if n == d.obj.size {
				// The end of a body of declared length: its readers get
				// it once the body is cached (see run).
				write = d.obj.body.writeLast
			}
			werr := write(d.ctx, buf[:k])
			if fe := (fileError{}); errors.As(werr, &fe) && !d.obj.body.relaying() {
				werr = d.relayInstead(f, fe, func() error { return write(d.ctx, buf[:k]) })
			}
			if werr != nil {
				return d.why(werr)
			}
			if n > d.limit && d.lease != nil && !d.streamed {
				// A body of unknown length just outgrew the store.
				d.tooBig()
				if !d.obj.keep {
					// Owed to nobody now: it stops if nobody reads.
					d.e.flights.unkeep(f)
				}
			}
			if d.obj.keep && d.unkeepable(n) {
				// Decided from the headers, undone by the body: a download
				// nobody will keep stops with its last reader (leave),
				// instead of running to max_object_bytes for nobody.
				d.e.flights.unkeep(f)
			}
		}
		if rerr == io.EOF {
			if d.obj.size >= 0 && n < d.obj.size {
				// Likewise: a short body must fail its readers, never be
				// cached as the whole answer.
				return d.why(fmt.Errorf("read upstream body: %d of %d bytes: %w", n, d.obj.size, io.ErrUnexpectedEOF))
			}
			return nil
		}
		if rerr != nil {
			return d.why(fmt.Errorf("read upstream body: %w", rerr))
		}
		stall.Reset(idle)
	}
}

// relayInstead goes on with a body whose spool file failed (disk full) as
// a relay to the requests already on the flight, rather than failing
// every one of them: the bytes they have not read yet are still in the
// spool, and from now on it holds one chunk. The body is not cached, new
// requests start a flight of their own, and the fleet's waiters fetch
// their own copy. retry writes the chunk that failed again.
func (d *download) relayInstead(f *flight, cause error, retry func() error) error {
	d.e.log.Warn("spool file failed; relaying the body to its readers uncached", "key", d.key, "err", cause)
	d.e.flights.drop(f)
	d.obj.body.startRelay()
	if d.lease != nil && !d.streamed {
		d.e.finishLease(d.e.base, d.lease, d.key, TooLarge(nil), 0)
		d.lease = nil
	}
	return retry()
}

// why puts the flight's reason first when it ended the download: the
// origin's read error then is only its symptom.
func (d *download) why(err error) error {
	cause := context.Cause(d.ctx)
	if cause == nil || errors.Is(err, cause) {
		return err
	}
	return fmt.Errorf("%w (%v)", cause, err)
}

// keep caches a complete body (see wholeBody): whole in the Store when it
// is small enough, else in the disk tier, and tells the fleet.
func (d *download) keep(body []byte, whole bool) {
	e := d.e
	n := d.obj.body.written()
	ent := *d.obj.meta
	ent.packed = packed{} // its fields change below
	ent.Header = ent.Header.Clone()
	ent.Header.Set("Content-Length", strconv.FormatInt(n, 10))
	if whole {
		ent.Body = body
		ttl := d.ttl
		if !d.keeping() {
			ttl = 0
		}
		e.keepEntry(e.settling(), d.key, &ent, ttl, d.lease)
		return
	}
	if d.lease != nil {
		e.finishLease(e.settling(), d.lease, d.key, TooLarge(nil), 0)
	}
	// A download that outlived its TTL (counted from its headers) is
	// expired already: kept, it would only evict fresh entries.
	if !d.keeping() || e.disk == nil || !time.Now().Before(ent.ExpiresAt) || e.invalidatedSince(d.key, &ent) {
		return
	}
	var err error
	if path, ok := d.obj.body.filePath(); ok {
		err = e.disk.put(d.key, &ent, path, n)
	} else if body != nil {
		err = e.disk.putBytes(d.key, &ent, body)
	}
	if err == nil && e.invalid.since(d.key, ent.URLKey, ent.askedAt()) {
		// Invalidated while it was being stored (see keepEntry).
		e.disk.delete(d.key)
	}
	if err != nil && !errors.Is(err, errTooBigForDisk) && !errors.Is(err, errNoDiskRoom) {
		e.log.Warn("disk tier store failed; response served uncached", "key", d.key, "err", err)
	}
}

// unkeepable reports whether a body n bytes in can no longer be kept: of
// unknown length and past every tier (canKeep), or past its expiry (keep
// refuses a body that expired while it came). Read by the download's own
// goroutine, which alone sets keep to false here; others read it under
// the flights' lock.
func (d *download) unkeepable(n int64) bool {
	if d.obj.size < 0 && !d.e.canKeep(n) {
		return true
	}
	exp := d.obj.meta.ExpiresAt
	return !exp.IsZero() && time.Now().After(exp)
}

func (d *download) keeping() bool {
	d.e.flights.mu.Lock()
	defer d.e.flights.mu.Unlock()
	return d.obj.keep
}
