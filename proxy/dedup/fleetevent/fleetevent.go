// Package fleetevent is what the instances of a fleet tell each other on
// their shared store's channel (a Redis channel, a PostgreSQL NOTIFY), and
// the local waiters those messages wake. Both stores speak the same
// grammar, so it is written once:
//
//	d <key>                        a flight for key ended (value, outcome or none)
//	i <key>                        key was invalidated
//	u <urlkey>                     every key of a URL was invalidated
//	r <key> <stored at, unix ms>   a copy cached during an outage replaced an older one
//	n <instance> <topic> <message> a note (upstream.Bus) from instance
//
// What arrives is untrusted: another version, a person with redis-cli or
// psql. Parse and ParseNote accept only this grammar; the stores count and
// ignore the rest.
package fleetevent

import (
	"context"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Kind is the first field of a message.
type Kind byte

// The kinds of message.
const (
	FlightEnded    Kind = 'd'
	Invalidated    Kind = 'i'
	URLInvalidated Kind = 'u'
	Replaced       Kind = 'r'
	Note           Kind = 'n'
)

// Format is the message of kind k about arg.
func Format(k Kind, arg string) string { return string(k) + " " + arg }

// FormatReplaced is the Replaced message: key's copy stored at storedMs.
func FormatReplaced(key string, storedMs int64) string {
	return Format(Replaced, key+" "+strconv.FormatInt(storedMs, 10))
}

// FormatNote is the Note message of topic from instance.
func FormatNote(instance, topic, msg string) string {
	return Format(Note, instance+" "+topic+" "+msg)
}

// Parse splits a message into its kind and argument; ok is false for
// anything outside the grammar (an unknown kind, no argument).
func Parse(payload string) (k Kind, arg string, ok bool) {
	kind, arg, ok := strings.Cut(payload, " ")
	if !ok || len(kind) != 1 || arg == "" {
		return 0, "", false
	}
	switch k := Kind(kind[0]); k {
	case FlightEnded, Invalidated, URLInvalidated, Replaced, Note:
		return k, arg, true
	}
	return 0, "", false
}

// ParseReplaced splits a Replaced message's argument into its key and the
// Unix milliseconds its copy was stored at.
func ParseReplaced(arg string) (key string, storedMs int64, ok bool) {
	key, at, ok := strings.Cut(arg, " ")
	ms, err := strconv.ParseInt(at, 10, 64)
	if !ok || key == "" || err != nil {
		return "", 0, false
	}
	return key, ms, true
}

// ParseNote splits a Note's argument into its sender, topic and message.
func ParseNote(arg string) (from, topic, msg string, ok bool) {
	from, rest, ok := strings.Cut(arg, " ")
	if !ok || from == "" {
		return "", "", "", false
	}
	topic, msg, ok = strings.Cut(rest, " ")
	if !ok || topic == "" {
		return "", "", "", false
	}
	return from, topic, msg, true
}

// Handler receives a topic's notes: msg, and for a lasting note recalled
// from the store how long it still holds (0 for a note as it is sent).
type Handler func(msg string, left time.Duration)

// Topics routes Notes to this instance's handlers, one per topic. The
// zero value is ready.
type Topics struct {
	mu sync.RWMutex
	m  map[string]Handler
}

// Set makes f the handler of topic.
func (t *Topics) Set(topic string, f Handler) {
	t.mu.Lock()
	if t.m == nil {
		t.m = make(map[string]Handler)
	}
	t.m[topic] = f
	t.mu.Unlock()
}

// All returns a copy of the handlers by topic.
func (t *Topics) All() map[string]Handler {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return maps.Clone(t.m)
}

// Deliver hands a Note's argument to its topic's handler unless self (this
// instance) sent it. It reports false for a note outside the grammar.
func (t *Topics) Deliver(self, arg string) bool {
	from, topic, msg, ok := ParseNote(arg)
	if !ok {
		return false
	}
	if from == self {
		return true
	}
	t.mu.RLock()
	f := t.m[topic]
	t.mu.RUnlock()
	if f != nil {
		f(msg, 0)
	}
	return true
}

// Waiters maps a key to the local waiters to wake when a flight for it
// ends anywhere in the fleet. The zero value is ready.
type Waiters struct {
	mu sync.Mutex
	m  map[string]map[chan struct{}]struct{}
	// woken counts the wake-ups of the keys of each bucket (keyBucket),
	// written under mu, read by Mark without it.
	woken [wakeBuckets]atomic.Uint64
}

// wakeBuckets is how many counters the keys share: a wake-up of another
// key of the same bucket between a waiter's Mark and its Add costs that
// waiter one more look at the store, never a missed wake-up.
const wakeBuckets = 1024

// Mark is where a key's bucket of wake-ups stood at Waiters.Mark.
type Mark struct {
	bucket uint32
	woken  uint64
}

// Mark is taken before the first look at the store; the waiter registers
// with Add only once it has to wait. A request that leads or finds the
// value so registers nothing, and a message between the look and the wait
// still wakes the waiter (Add sees it counted).
func (w *Waiters) Mark(key string) Mark {
	b := keyBucket(key)
	return Mark{bucket: b, woken: w.woken[b].Load()}
}

// keyBucket is key's FNV-1a hash, cut to a bucket.
func keyBucket(key string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(key); i++ {
		h ^= uint32(key[i])
		h *= 16777619
	}
	return h % wakeBuckets
}

// Add registers a waiter for key; its channel holds one pending wake-up,
// there at once when key's bucket woke since m (taken by Mark for key).
func (w *Waiters) Add(key string, m Mark) chan struct{} {
	ch := make(chan struct{}, 1)
	w.mu.Lock()
	if w.m == nil {
		w.m = make(map[string]map[chan struct{}]struct{})
	}
	set := w.m[key]
	if set == nil {
		set = make(map[chan struct{}]struct{})
		w.m[key] = set
	}
	set[ch] = struct{}{}
	if w.woken[m.bucket].Load() != m.woken {
		notify(ch)
	}
	w.mu.Unlock()
	return ch
}

// Remove unregisters the waiter ch of key.
func (w *Waiters) Remove(key string, ch chan struct{}) {
	w.mu.Lock()
	delete(w.m[key], ch)
	if len(w.m[key]) == 0 {
		delete(w.m, key)
	}
	w.mu.Unlock()
}

// PollBatch bounds the keys one check of Poll is asked about.
const PollBatch = 512

// Poll is the waiters' safety net, for a lost message or a dead leader:
// every interval until ctx ends, check is asked about the keys that have
// waiters (PollBatch at a time, in one statement or pipeline of the
// store's), and the waiters of the keys it returns look again with a
// step of their own. A check that fails wakes them all: each then meets
// the failure in its own step. One check per instance replaces a look by
// every waiter: 500 waits on a slow origin were 5,000 store round trips
// or scripts a second, for an answer the message brings anyway.
func (w *Waiters) Poll(ctx context.Context, interval time.Duration, check func(ctx context.Context, keys []string) (ready []string, err error)) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
		w.mu.Lock()
		keys := slices.Collect(maps.Keys(w.m))
		w.mu.Unlock()
		for batch := range slices.Chunk(keys, PollBatch) {
			ready, err := check(ctx, batch)
			if ctx.Err() != nil {
				return
			}
			if err != nil {
				ready = batch
			}
			for _, k := range ready {
				w.Wake(k)
			}
		}
	}
}

// Wake wakes key's waiters.
func (w *Waiters) Wake(key string) {
	w.mu.Lock()
	w.woken[keyBucket(key)].Add(1)
	for ch := range w.m[key] {
		notify(ch)
	}
	w.mu.Unlock()
}

// WakeAll makes every waiter look again: messages sent while the
// listener was away are lost.
func (w *Waiters) WakeAll() {
	w.mu.Lock()
	for i := range w.woken {
		w.woken[i].Add(1)
	}
	for _, set := range w.m {
		for ch := range set {
			notify(ch)
		}
	}
	w.mu.Unlock()
}

func notify(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default: // already has a pending wake-up
	}
}
