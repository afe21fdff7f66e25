package fingerprint

import (
	"testing"
)

func TestIDNormalizesPerConnectionParts(t *testing.T) {
	base := chrome143(t)
	parse := func(s helloSpec) *ClientHello {
		t.Helper()
		h, err := ParseClientHello(s.build())
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	h2 := &H2{Settings: []Setting{{1, 65536}}, WindowUpdate: 15663105, PseudoOrder: []string{":method", ":authority", ":scheme", ":path"}, FirstStreamID: 1}
	id := New(parse(base), h2).ID()

	// What changes on every connection of the same browser.
	same := map[string]func(*helloSpec){
		"grease values": func(s *helloSpec) {
			s.ciphers = append([]uint16{0xdada}, s.ciphers[1:]...)
			s.exts = append(append([]uint16{0x7a7a}, s.exts[1:len(s.exts)-1]...), 0x9a9a)
			s.groups = append([]uint16{0x3a3a}, s.groups[1:]...)
			s.versions = append([]uint16{0xeaea}, s.versions[1:]...)
		},
		"extension shuffle": func(s *helloSpec) {
			e := append([]uint16(nil), s.exts...)
			e[1], e[5], e[9] = e[9], e[1], e[5]
			s.exts = e
		},
		"server name": func(s *helloSpec) { s.sni = "another.example" },
		"session id":  func(s *helloSpec) { s.sessionLen = 0 },
	}
	for name, mod := range same {
		s := base
		mod(&s)
		if got := New(parse(s), h2).ID(); got != id {
			t.Errorf("%s changed the ID", name)
		}
	}

	// What an origin can tell apart.
	differ := map[string]func(*helloSpec){
		"a cipher less":     func(s *helloSpec) { s.ciphers = s.ciphers[:len(s.ciphers)-1] },
		"alpn":              func(s *helloSpec) { s.alpn = []string{"http/1.1"} },
		"sig algs order":    func(s *helloSpec) { s.sigAlgs = append(s.sigAlgs[1:len(s.sigAlgs):len(s.sigAlgs)], s.sigAlgs[0]) },
		"grease position":   func(s *helloSpec) { s.ciphers = append(s.ciphers[1:len(s.ciphers):len(s.ciphers)], 0x2a2a) },
		"key share groups":  func(s *helloSpec) { s.keyShares = []uint16{0x5a5a, 29} },
		"extension missing": func(s *helloSpec) { s.exts = s.exts[1:] },
	}
	for name, mod := range differ {
		s := base
		mod(&s)
		if got := New(parse(s), h2).ID(); got == id {
			t.Errorf("%s kept the ID", name)
		}
	}
	h := parse(base)
	for name, other := range map[string]*H2{
		"no h2 (an HTTP/1.1 client)": nil,
		"settings value":             {Settings: []Setting{{1, 4096}}, WindowUpdate: 15663105, PseudoOrder: h2.PseudoOrder, FirstStreamID: 1},
		"pseudo order":               {Settings: h2.Settings, WindowUpdate: 15663105, PseudoOrder: []string{":method", ":path", ":authority", ":scheme"}, FirstStreamID: 1},
	} {
		if New(h, other).ID() == id {
			t.Errorf("%s kept the ID", name)
		}
	}
	if (&Fingerprint{Hello: h, H2: h2}).ID() != id {
		t.Error("a literal Fingerprint computes another ID")
	}
}
