package dedup

import "testing"

// TestInvalidationHooks: each registered hook hears every invalidation
// until its stop, and none after it (the engine closes its disk tier right
// after stopping its hook).
func TestInvalidationHooks(t *testing.T) {
	var h InvalidationHooks
	var a, b []Invalidation
	stopA := h.OnInvalidated(func(inv Invalidation) { a = append(a, inv) })
	stopB := h.OnInvalidated(func(inv Invalidation) { b = append(b, inv) })
	h.Invalidated(Invalidation{Key: "k1"})
	stopA()
	h.Invalidated(Invalidation{URLKey: "u1"})
	stopB()
	stopB() // twice is harmless
	h.Invalidated(Invalidation{Key: "k2"})
	if len(a) != 1 || a[0].Key != "k1" {
		t.Errorf("the first hook heard %v, want k1 alone", a)
	}
	if len(b) != 2 || b[0].Key != "k1" || b[1].URLKey != "u1" {
		t.Errorf("the second hook heard %v, want k1 then u1", b)
	}
}
