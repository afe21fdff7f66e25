package rediscache

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// The batcher sends the round trips of concurrent requests to Redis
// together: one write and one read for many. Every round trip costs both
// sides system calls and a wake-up, and on Redis's one command core that
// socket work competes with the commands themselves. With 32 unique misses
// in flight (BenchmarkStores) a miss went from 2 round trips to 0.58, and
// the instance from 4,500–5,400 to 7,100–7,300 misses/s. Batching costs a
// request alone nothing: an idle flusher sends it at once. Requests wait
// for company only when every flusher is busy, and then only for the round
// trip already on the wire, or while other goroutines are ready to run.
//
// Written here rather than with go-redis's AutoPipeline (v9.22, marked
// experimental): that batches single commands, while a flight's step is a
// pipeline of its own (a GET with the join script; a SET, the finish
// script and the URL index) whose commands must stay in one round trip.

const (
	// flushers is how many batches may be on the wire at once. More means
	// a big value (a SET of megabytes) holds up fewer requests behind it;
	// fewer means deeper batches. Measured with BenchmarkStores (32 unique
	// misses in flight on 2 cores): 1 flusher 0.40 round trips per miss,
	// 2 flushers 0.58 at the same req/s, 4 flushers 0.76 and 13% fewer
	// req/s. Measured again later, alternating: 1 flusher 0.42 round
	// trips and 5–12% fewer req/s than 2, with redis-server's CPU per
	// miss unchanged (its cost follows the commands, not the trips).
	flushers = 2
	// maxBatch bounds the steps sent in one pipeline, so one write stays
	// a bounded burst.
	maxBatch = 128
)

// errClosed answers a step sent after the client closed.
var errClosed = errors.New("rediscache: closed")

// step is one request's pipeline, sent with others.
type step struct {
	ctx   context.Context
	queue func(redis.Pipeliner) // queues this step's commands
	cmds  []redis.Cmder         // its commands, answered
	err   error                 // set when the step was never sent
	// done receives once when cmds or err are set. A buffered channel
	// sent to rather than closed: a step is reused (stepPool) once its caller
	// has read it.
	done chan struct{}
	// late is when the step is refused if it has not been sent yet: a
	// step waits at most timeout for a flusher, and its batch's round trip
	// takes at most timeout, so do answers within twice timeout with no
	// timer of the step's own.
	late time.Time
}

// errLate answers a step that waited too long for a flusher: Redis is
// slow, and the breaker should hear of it.
var errLate = fmt.Errorf("rediscache: no flusher free in time: %w", context.DeadlineExceeded)

// batcher owns the flushers; they stop with life.
type batcher struct {
	rdb     redis.UniversalClient
	timeout time.Duration // of a batch's round trip, as of one command
	steps   chan *step
	life    context.Context
	stopped chan struct{} // closed when every flusher has returned
}

// newBatcher starts the flushers; wg is the owner's, waited on at Close.
func newBatcher(life context.Context, wg *sync.WaitGroup, rdb redis.UniversalClient, timeout time.Duration) *batcher {
	b := &batcher{rdb: rdb, timeout: timeout, steps: make(chan *step, maxBatch*flushers), life: life, stopped: make(chan struct{})}
	var running sync.WaitGroup
	for range flushers {
		running.Go(b.flusher)
	}
	wg.Go(func() {
		running.Wait()
		close(b.stopped)
	})
	return b
}

// do sends queue's commands in the next batch and returns them answered,
// in the order queued. A command's own error is on the command; the error
// returned is for a step that never reached Redis (ctx done, closed, no
// flusher free within the timeout). It answers within twice the timeout
// whatever ctx allows: once to be sent, once for the round trip.
func (b *batcher) do(ctx context.Context, queue func(redis.Pipeliner)) ([]redis.Cmder, error) {
	s := stepPool.Get().(*step)
	s.ctx, s.queue, s.late = ctx, queue, time.Now().Add(b.timeout)
	select {
	case b.steps <- s:
	case <-ctx.Done():
		s.recycle()
		return nil, ctx.Err()
	case <-b.life.Done():
		s.recycle()
		return nil, errClosed
	}
	select {
	case <-s.done:
		return s.answer()
	case <-ctx.Done():
		// The batch goes on without us; what it did stays done, as when
		// a caller gives up on a command already sent. The flusher still
		// holds the step: it is not reused.
		return nil, ctx.Err()
	case <-b.stopped:
		select {
		case <-s.done:
			return s.answer()
		default:
			return nil, errClosed
		}
	}
}

// stepPool holds steps for reuse: two per miss, each with its channel.
var stepPool = sync.Pool{New: func() any { return &step{done: make(chan struct{}, 1)} }}

// answer returns what the flusher set and recycles s.
func (s *step) answer() ([]redis.Cmder, error) {
	cmds, err := s.cmds, s.err
	s.recycle()
	return cmds, err
}

// recycle clears s, answered or never queued, and pools it.
func (s *step) recycle() {
	*s = step{done: s.done}
	stepPool.Put(s)
}

// finish hands s its answer.
func (s *step) finish() { s.done <- struct{}{} }

func (b *batcher) flusher() {
	batch := make([]*step, 0, maxBatch)
	bounds := make([]int, 0, maxBatch+1)
	for {
		var first *step
		select {
		case first = <-b.steps:
		case <-b.life.Done():
			b.drain()
			return
		}
		batch = append(batch[:0], first)
		// Let the goroutines already runnable go first: under load some of
		// them are about to queue a step, which then shares this round
		// trip. A flusher on an idle machine gets the processor straight
		// back, so a request alone still goes at once. Measured with
		// BenchmarkStores (unique misses, 2 cores): 0.45 round trips per
		// miss instead of 0.57, and 11% less of redis-server's CPU and 7%
		// less of the instance's per miss.
		runtime.Gosched()
	more:
		for len(batch) < maxBatch {
			select {
			case s := <-b.steps:
				batch = append(batch, s)
			default:
				break more
			}
		}
		bounds = b.send(batch, bounds)
		clear(batch) // the steps are their callers' now
	}
}

// send runs one pipeline of the batch's live steps and hands each its
// commands.
func (b *batcher) send(batch []*step, bounds []int) []int {
	live := batch[:0]
	now := time.Now()
	for _, s := range batch {
		err := s.ctx.Err()
		if err == nil && now.After(s.late) {
			err = errLate
		}
		if err != nil {
			s.err = err
			s.finish()
			continue
		}
		live = append(live, s)
	}
	if len(live) == 0 {
		return bounds
	}
	ctx, cancel := context.WithTimeout(b.life, b.timeout)
	defer cancel()
	bounds = bounds[:0]
	cmds, _ := b.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, s := range live {
			bounds = append(bounds, p.Len())
			s.queue(p)
		}
		bounds = append(bounds, p.Len())
		return nil
	})
	for i, s := range live {
		if lo, hi := bounds[i], bounds[i+1]; hi <= len(cmds) {
			s.cmds = cmds[lo:hi:hi]
		} else {
			s.err = errClosed // Pipelined refused the batch before sending it
		}
		s.finish()
	}
	return bounds
}

// drain answers the steps still queued once the client is closing.
func (b *batcher) drain() {
	for {
		select {
		case s := <-b.steps:
			s.err = errClosed
			s.finish()
		default:
			return
		}
	}
}
