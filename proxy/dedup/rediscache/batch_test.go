package rediscache

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/seed-a3c387e8/onceproxy/internal/redistest"
)

// startBatcher runs a batcher on a private redis-server until t ends,
// logging the round trips it makes.
func startBatcher(t *testing.T) (*batcher, *tripLog) {
	rdb := redistest.Start(t).Client()
	trips := &tripLog{}
	rdb.AddHook(trips)
	life, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { stop(); wg.Wait() })
	return newBatcher(life, &wg, rdb, 5*time.Second), trips
}

// TestBatcherSharesRoundTrips: 200 steps sent at once from 200 goroutines,
// each a pipeline of its own (SET then GET of its key), reach Redis in far
// fewer round trips than steps, and every step gets its own commands back,
// answered, in the order it queued them.
func TestBatcherSharesRoundTrips(t *testing.T) {
	b, trips := startBatcher(t)

	const n = 200
	start := make(chan struct{})
	errs := make(chan error, n)
	var all sync.WaitGroup
	for i := range n {
		all.Go(func() {
			<-start
			key := fmt.Sprintf("batch:%d", i)
			cmds, err := b.do(context.Background(), func(p redis.Pipeliner) {
				p.Set(context.Background(), key, i, time.Minute)
				p.Get(context.Background(), key)
			})
			if err != nil {
				errs <- err
				return
			}
			if len(cmds) != 2 {
				errs <- fmt.Errorf("step %d: %d commands back", i, len(cmds))
				return
			}
			if got, err := cmds[1].(*redis.StringCmd).Int(); err != nil || got != i {
				errs <- fmt.Errorf("step %d: GET answered %d, %v", i, got, err)
			}
		})
	}
	close(start)
	all.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	trips.mu.Lock()
	nTrips := len(trips.trips)
	trips.mu.Unlock()
	t.Logf("%d steps in %d round trips", n, nTrips)
	if nTrips >= n/2 {
		t.Errorf("%d steps took %d round trips: not batched", n, nTrips)
	}
}

// TestBatcherAlone: a step with nothing else queued goes at once, in a
// round trip of its own.
func TestBatcherAlone(t *testing.T) {
	b, trips := startBatcher(t)
	for i := range 3 {
		cmds, err := b.do(context.Background(), func(p redis.Pipeliner) { p.Ping(context.Background()) })
		if err != nil || len(cmds) != 1 || cmds[0].Err() != nil {
			t.Fatalf("step %d: %v %v", i, cmds, err)
		}
	}
	pings := 0
	for _, trip := range trips.trips {
		for _, c := range trip {
			if c == "ping" {
				pings++
				if len(trip) != 1 {
					t.Errorf("a step alone went with others: %v", trip)
				}
			}
		}
	}
	if pings != 3 {
		t.Errorf("3 steps one after another: %d PINGs sent, want 3 (%v)", pings, trips.trips)
	}
}

// TestBatcherGivesUp: a caller whose context ends stops waiting for a
// Redis that does not answer; once closed, the batcher answers at once.
func TestBatcherGivesUp(t *testing.T) {
	// A server that accepts and never answers.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	rdb := redis.NewClient(&redis.Options{Addr: ln.Addr().String(), Protocol: 2, ContextTimeoutEnabled: true, MaxRetries: -1, ReadTimeout: 300 * time.Millisecond})
	defer rdb.Close()
	life, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	b := newBatcher(life, &wg, rdb, time.Minute)

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	began := time.Now()
	_, err = b.do(ctx, func(p redis.Pipeliner) { p.Ping(ctx) })
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("step to a silent server: %v, want the caller's deadline", err)
	}
	if waited := time.Since(began); waited > 5*time.Second {
		t.Errorf("caller waited %s past its deadline", waited)
	}

	// Close ends the batch on the wire too, and answers later steps.
	stop()
	wg.Wait()
	if _, err := b.do(context.Background(), func(p redis.Pipeliner) { p.Ping(context.Background()) }); !errors.Is(err, errClosed) {
		t.Errorf("step after close: %v, want errClosed", err)
	}
}

// TestBatcherRefusesLateSteps: a step that waited longer than the timeout
// for a flusher is answered with errLate (a DeadlineExceeded, which the
// breaker counts) and never sent; a step in time goes.
func TestBatcherRefusesLateSteps(t *testing.T) {
	b, trips := startBatcher(t)
	late := &step{ctx: context.Background(), done: make(chan struct{}, 1), late: time.Now().Add(-time.Millisecond),
		queue: func(p redis.Pipeliner) { p.Echo(context.Background(), "late") }}
	inTime := &step{ctx: context.Background(), done: make(chan struct{}, 1), late: time.Now().Add(time.Minute),
		queue: func(p redis.Pipeliner) { p.Echo(context.Background(), "in time") }}
	b.send([]*step{late, inTime}, nil)
	<-late.done
	<-inTime.done
	if !errors.Is(late.err, errLate) || !errors.Is(late.err, context.DeadlineExceeded) || late.cmds != nil {
		t.Errorf("late step: err %v, cmds %v; want errLate and nothing sent", late.err, late.cmds)
	}
	if inTime.err != nil || len(inTime.cmds) != 1 || inTime.cmds[0].Err() != nil {
		t.Errorf("step in time: err %v, cmds %v", inTime.err, inTime.cmds)
	}
	for _, trip := range trips.snapshot().trips {
		for _, c := range trip {
			if c == "echo late" {
				t.Errorf("the late step was sent: %v", trip)
			}
		}
	}
}
