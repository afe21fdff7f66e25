package bufpool

import "testing"

func TestGetPut(t *testing.T) {
	b := Get()
	if len(*b) != Size {
		t.Fatalf("len %d, want %d", len(*b), Size)
	}
	*b = (*b)[:10]
	Put(b)
	if c := Get(); len(*c) != Size {
		t.Fatalf("a buffer put back short comes back with len %d", len(*c))
	}
}

func BenchmarkGetPut(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		Put(Get())
	}
}
