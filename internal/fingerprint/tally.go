package fingerprint

import (
	"cmp"
	"slices"
	"sync"
	"time"
)

// A Tally counts the distinct client fingerprints seen recently, for people
// to read (what software the clients run): a JA4 identifies a TLS stack,
// not a person. It remembers at most its capacity of fingerprints; a new
// one beyond it replaces the one seen longest ago. The zero value is not
// usable: make one with NewTally. It is safe for concurrent use.
type Tally struct {
	mu  sync.Mutex
	max int
	m   map[ID]*Seen
}

// Seen is one fingerprint of a Tally.
type Seen struct {
	JA4    string    `json:"ja4"`
	HTTP   string    `json:"http"`             // "h2" when the client spoke HTTP/2, else "h1"
	Akamai string    `json:"akamai,omitempty"` // its HTTP/2 fingerprint
	Count  int64     `json:"count"`            // connections
	Last   time.Time `json:"last_seen"`
}

// NewTally returns a Tally of at most capacity fingerprints (at least 1).
func NewTally(capacity int) *Tally {
	return &Tally{max: max(capacity, 1), m: make(map[ID]*Seen)}
}

// Add counts one connection with fingerprint f at now. Fingerprints without
// a ClientHello (plain HTTP) have no JA4 and are not counted.
func (t *Tally) Add(f *Fingerprint, now time.Time) {
	if f == nil || f.Hello == nil {
		return
	}
	id := f.ID()
	t.mu.Lock()
	defer t.mu.Unlock()
	if s, ok := t.m[id]; ok {
		s.Count++
		s.Last = now
		return
	}
	if len(t.m) >= t.max {
		var oldest ID
		var at time.Time
		first := true
		for k, s := range t.m {
			if first || s.Last.Before(at) {
				oldest, at, first = k, s.Last, false
			}
		}
		delete(t.m, oldest)
	}
	s := &Seen{JA4: f.Hello.JA4(), HTTP: "h1", Count: 1, Last: now}
	if f.H2 != nil {
		s.HTTP, s.Akamai = "h2", f.H2.Akamai()
	}
	t.m[id] = s
}

// Top returns the n most frequent fingerprints, most frequent first (ties:
// the most recently seen first).
func (t *Tally) Top(n int) []Seen {
	t.mu.Lock()
	out := make([]Seen, 0, len(t.m))
	for _, s := range t.m {
		out = append(out, *s)
	}
	t.mu.Unlock()
	slices.SortFunc(out, func(a, b Seen) int {
		if c := cmp.Compare(b.Count, a.Count); c != 0 {
			return c
		}
		return b.Last.Compare(a.Last)
	})
	if len(out) > n {
		out = out[:n]
	}
	return out
}
