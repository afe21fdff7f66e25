package fingerprint

import (
	"testing"
	"time"
)

// TestTallyBoundedMostFrequentFirst: a tally counts connections per
// fingerprint, lists the most frequent first, forgets the one seen longest
// ago when full, and ignores fingerprints without a hello.
func TestTallyBoundedMostFrequentFirst(t *testing.T) {
	var hellos []*ClientHello
	for _, ciphers := range [][]uint16{{0x1301}, {0x1302}, {0x1303}} {
		h, err := ParseClientHello(helloSpec{ciphers: ciphers, exts: []uint16{ExtSupportedVersions}, versions: []uint16{0x0304}}.build())
		if err != nil {
			t.Fatal(err)
		}
		hellos = append(hellos, h)
	}
	tally := NewTally(2)
	t0 := time.Unix(1000, 0)
	tally.Add(New(hellos[0], nil), t0)
	tally.Add(New(hellos[1], nil), t0.Add(time.Second))
	tally.Add(New(hellos[1], nil), t0.Add(2*time.Second))
	tally.Add(New(nil, nil), t0.Add(3*time.Second)) // plain HTTP: no JA4
	top := tally.Top(10)
	if len(top) != 2 || top[0].JA4 != hellos[1].JA4() || top[0].Count != 2 || top[1].Count != 1 || top[0].HTTP != "h1" {
		t.Fatalf("top %+v", top)
	}
	// Full: the third fingerprint replaces the one seen longest ago.
	tally.Add(New(hellos[2], &H2{Settings: []Setting{{ID: 1, Val: 65536}}}), t0.Add(4*time.Second))
	top = tally.Top(10)
	if len(top) != 2 || top[0].JA4 != hellos[1].JA4() || top[1].JA4 != hellos[2].JA4() || top[1].HTTP != "h2" || top[1].Akamai == "" {
		t.Fatalf("after eviction %+v", top)
	}
	if top := tally.Top(1); len(top) != 1 || top[0].Count != 2 {
		t.Fatalf("Top(1) %+v", top)
	}
}
