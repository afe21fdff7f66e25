package fleetevent

import (
	"testing"
	"time"
)

func TestFormatParse(t *testing.T) {
	for _, c := range []struct {
		msg  string
		kind Kind
		arg  string
	}{
		{Format(FlightEnded, "v1:abc"), FlightEnded, "v1:abc"},
		{Format(Invalidated, "{t}k"), Invalidated, "{t}k"},
		{Format(URLInvalidated, "u1:ff"), URLInvalidated, "u1:ff"},
		{FormatReplaced("v1:abc", 1700000000000), Replaced, "v1:abc 1700000000000"},
		{FormatNote("i1", "sessions", `{"session":"s1"}`), Note, `i1 sessions {"session":"s1"}`},
	} {
		k, arg, ok := Parse(c.msg)
		if !ok || k != c.kind || arg != c.arg {
			t.Errorf("Parse(%q) = %c %q %v, want %c %q", c.msg, k, arg, ok, c.kind, c.arg)
		}
	}
	for _, bad := range []string{"", "d", "d ", "x key", "dd key", " key", "D key", "é key"} {
		if k, arg, ok := Parse(bad); ok {
			t.Errorf("Parse(%q) accepted: %c %q", bad, k, arg)
		}
	}
}

func TestParseReplaced(t *testing.T) {
	if key, ms, ok := ParseReplaced("v1:abc 1700000000000"); !ok || key != "v1:abc" || ms != 1700000000000 {
		t.Errorf("got %q %d %v", key, ms, ok)
	}
	for _, bad := range []string{"", "v1:abc", "v1:abc ", " 17", "v1:abc x", "v1:abc 1.5"} {
		if key, ms, ok := ParseReplaced(bad); ok {
			t.Errorf("ParseReplaced(%q) accepted: %q %d", bad, key, ms)
		}
	}
}

func TestParseNote(t *testing.T) {
	from, topic, msg, ok := ParseNote("i1 sessions a b c")
	if !ok || from != "i1" || topic != "sessions" || msg != "a b c" {
		t.Errorf("got %q %q %q %v", from, topic, msg, ok)
	}
	if _, _, msg, ok := ParseNote("i1 empty "); !ok || msg != "" {
		t.Errorf("an empty message: %q %v", msg, ok)
	}
	for _, bad := range []string{"", "i1", "i1 ", " topic msg", "i1  msg", "i1 topic"} {
		if from, topic, msg, ok := ParseNote(bad); ok {
			t.Errorf("ParseNote(%q) accepted: %q %q %q", bad, from, topic, msg)
		}
	}
}

// TestWakeBetweenMarkAndAdd: a wake-up that comes after a waiter's Mark
// (its first look at the store) but before it registers is pending in the
// channel Add returns; one from before the Mark is not.
func TestWakeBetweenMarkAndAdd(t *testing.T) {
	var w Waiters
	w.Wake("k") // before the look: the look saw its result
	m := w.Mark("k")
	quiet := w.Add("k", m)
	select {
	case <-quiet:
		t.Error("a wake-up from before the Mark is pending")
	default:
	}
	w.Remove("k", quiet)

	m = w.Mark("k")
	w.Wake("k") // between the look and the registration
	late := w.Add("k", m)
	select {
	case <-late:
	default:
		t.Error("a wake-up between Mark and Add was lost")
	}

	m = w.Mark("k")
	w.WakeAll() // a reconnect between the look and the registration
	select {
	case <-w.Add("k", m):
	default:
		t.Error("WakeAll between Mark and Add was lost")
	}
}

func TestWaiters(t *testing.T) {
	var w Waiters
	a1, a2, b := w.Add("a", w.Mark("a")), w.Add("a", w.Mark("a")), w.Add("b", w.Mark("b"))
	w.Wake("a")
	w.Wake("a") // a second wake-up before the first is taken: one pending
	for name, ch := range map[string]chan struct{}{"a1": a1, "a2": a2} {
		select {
		case <-ch:
		default:
			t.Errorf("%s not woken", name)
		}
		select {
		case <-ch:
			t.Errorf("%s woken twice", name)
		default:
		}
	}
	select {
	case <-b:
		t.Error("b woken by a's flight")
	default:
	}
	w.Remove("a", a1)
	w.Wake("a")
	select {
	case <-a1:
		t.Error("a removed waiter was woken")
	default:
	}
	<-a2
	w.WakeAll()
	<-a2
	<-b
	w.Remove("a", a2)
	w.Remove("b", b)
	if len(w.m) != 0 {
		t.Errorf("keys left after every waiter went: %v", w.m)
	}
}

func TestTopicsDeliver(t *testing.T) {
	var tp Topics
	var got []string
	tp.Set("session", func(msg string, left time.Duration) { got = append(got, msg) })
	for _, c := range []struct {
		arg string
		ok  bool
	}{
		{"other session m1", true},
		{"me session m2", true},    // its own note: read, not delivered
		{"other unheard m3", true}, // no handler: read, dropped
		{"other session", false},   // no message separator
		{"", false},
	} {
		if ok := tp.Deliver("me", c.arg); ok != c.ok {
			t.Errorf("Deliver(%q) = %v, want %v", c.arg, ok, c.ok)
		}
	}
	if len(got) != 1 || got[0] != "m1" {
		t.Errorf("delivered %q, want [m1]", got)
	}
	if all := tp.All(); len(all) != 1 || all["session"] == nil {
		t.Errorf("All() = %v", all)
	}
}
