package mirror

import (
	"crypto/ecdh"
	"crypto/rand"
	"fmt"
	"net"
	"slices"

	utls "github.com/bogdanfinn/utls"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
)

// computable reports whether utls can make a key share for the group:
// the classical curves and the two X25519 hybrids.
func computable(g utls.CurveID) bool {
	switch g {
	case utls.X25519, utls.CurveP256, utls.CurveP384, utls.CurveP521,
		utls.X25519MLKEM768, utls.X25519Kyber768Draft00:
		return true
	}
	return false
}

func classical(g utls.CurveID) bool {
	switch g {
	case utls.X25519, utls.CurveP256, utls.CurveP384, utls.CurveP521:
		return true
	}
	return false
}

// buildSpec parses the client's raw hello into a fresh utls spec for one
// dial and edits it for the mode: always without pre_shared_key and
// early_data; without key shares utls cannot compute; and for Closest
// (the rung after a refusal) also without the extensions sent verbatim or
// only advertised, without groups utls lacks, and with one classical key
// share (utls keeps a private key for the first one only).
//
// keyGroup, when not 0, is the classical group whose share keeps the
// private key (the one the origin picks): the classical shares before it
// go out with fresh public keys whose private keys are dropped, which
// leaves the hello as the client's. Closest ignores it.
func buildSpec(hello *fingerprint.ClientHello, serverName string, mode Mode, keyGroup utls.CurveID) (*utls.ClientHelloSpec, Report, error) {
	spec := &utls.ClientHelloSpec{}
	// Blunt mimicry: an extension utls does not know goes out verbatim
	// instead of failing the parse. (Chrome's trust_anchors, 0xca34, is one.)
	if err := spec.FromRaw(hello.Raw, true, false); err != nil {
		return nil, Report{}, err
	}
	r := Report{Mode: Mirrored}
	change := func(format string, args ...any) {
		r.Mode = Closest
		r.Changes = append(r.Changes, fmt.Sprintf(format, args...))
	}
	strict := mode == Closest
	if strict {
		r.Mode = Closest
		r.Changes = append(r.Changes, "the origin refused the mirrored hello")
	}
	kept := spec.Extensions[:0]
	for _, e := range spec.Extensions {
		switch x := e.(type) {
		case utls.PreSharedKeyExtension:
			// The client's tickets were issued by the proxy, not the origin.
			r.Changes = append(r.Changes, "no pre_shared_key (the client's ticket is the proxy's)")
			continue
		case *utls.GenericExtension:
			if x.Id == fingerprint.ExtEarlyData {
				r.Changes = append(r.Changes, "no early_data")
				continue
			}
			if strict {
				change("dropped extension %#04x (sent verbatim before)", x.Id)
				continue
			}
			r.Verbatim = append(r.Verbatim, x.Id)
		case *utls.FakeRecordSizeLimitExtension, *utls.FakeDelegatedCredentialsExtension,
			*utls.FakeTokenBindingExtension, *utls.FakeChannelIDExtension:
			if strict {
				change("dropped advertise-only extension %T", e)
				continue
			}
		case *utls.SNIExtension:
			// The name the caller verifies the origin against; an address
			// cannot be an SNI, so then the client's name stays.
			if net.ParseIP(serverName) == nil {
				x.ServerName = serverName
			}
		case *utls.KeyShareExtension:
			shares := x.KeyShares[:0]
			seenClassical := false
			for _, ks := range x.KeyShares {
				g := ks.Group
				switch {
				case fingerprint.IsGREASE(uint16(g)):
				case !computable(g):
					change("dropped key share of group %#04x (utls cannot compute it)", uint16(g))
					continue
				case strict && classical(g) && seenClassical:
					change("dropped key share of group %#04x (a second classical share)", uint16(g))
					continue
				}
				if classical(g) {
					seenClassical = true
				}
				shares = append(shares, ks)
			}
			x.KeyShares = shares
			if !strict && keyGroup != 0 {
				if err := keyOn(shares, keyGroup); err != nil {
					return nil, Report{}, err
				}
			}
		case *utls.SupportedCurvesExtension:
			if strict {
				n := len(x.Curves)
				x.Curves = slices.DeleteFunc(x.Curves, func(g utls.CurveID) bool {
					return !fingerprint.IsGREASE(uint16(g)) && !computable(g)
				})
				if len(x.Curves) < n {
					change("dropped %d supported groups utls lacks", n-len(x.Curves))
				}
			}
		}
		kept = append(kept, e)
	}
	spec.Extensions = kept
	return spec, r, nil
}

// classicalShares lists the classical groups the hello has key shares
// for, in its order.
func classicalShares(hello *fingerprint.ClientHello) []utls.CurveID {
	var out []utls.CurveID
	for _, g := range hello.KeyShareGroups {
		if classical(utls.CurveID(g)) {
			out = append(out, utls.CurveID(g))
		}
	}
	return out
}

// keyOn makes the share of group g the one utls keeps the private key
// for: utls generates keys for the shares without data and keeps the
// first classical one's, so the classical shares before g get a public
// key here. Nothing changes when g has no share.
func keyOn(shares []utls.KeyShare, g utls.CurveID) error {
	at := slices.IndexFunc(shares, func(ks utls.KeyShare) bool { return ks.Group == g })
	if at < 0 {
		return nil
	}
	for i := range shares[:at] {
		var curve ecdh.Curve
		switch shares[i].Group {
		case utls.X25519:
			curve = ecdh.X25519()
		case utls.CurveP256:
			curve = ecdh.P256()
		case utls.CurveP384:
			curve = ecdh.P384()
		case utls.CurveP521:
			curve = ecdh.P521()
		default:
			continue
		}
		k, err := curve.GenerateKey(rand.Reader)
		if err != nil {
			return err
		}
		shares[i].Data = k.PublicKey().Bytes()
	}
	return nil
}
