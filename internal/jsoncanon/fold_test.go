package jsoncanon

import "testing"

// TestNamesEqualButForCase: encoding/json decodes an object into a struct
// matching member names case-insensitively (Unicode simple folding: "ſ" is
// an "s"), and the last match wins, so {"method":"b","Method":"a"} means
// "a" to a Go server while a key taking the member "method" reads "b", as
// for {"method":"b"}. Such an object is as ambiguous as one that repeats a
// name, and has no canonical form either.
func TestNamesEqualButForCase(t *testing.T) {
	for _, in := range []string{
		`{"method":"b","Method":"a"}`,
		`{"METHOD":"a","method":"b"}`,
		`{"skey":"y","\u017fkey":"x"}`, // U+017F LATIN SMALL LETTER LONG S
		`{"ſkey":"x","SKEY":"y"}`,
		`{"k":1,"\u212a":2}`, // U+212A KELVIN SIGN
	} {
		if members, ok := Object([]byte(in)); ok {
			t.Errorf("Object(%s) = %d members, true; want false", in, len(members))
		}
		nested := `{"x":` + in + `}`
		if got, ok := Append(nil, []byte(nested)); ok {
			t.Errorf("Append(%s) = %s, true; want false", nested, got)
		}
		members, ok := Object([]byte(nested))
		if !ok || len(members) != 1 {
			t.Fatalf("Object(%s) = %v, %v; want one member", nested, members, ok)
		}
		if got, ok := members[0].AppendValue(nil); ok {
			t.Errorf("AppendValue of %s = %s, true; want false", in, got)
		}
	}

	// Names that differ other than in case stay apart.
	for _, in := range []string{`{"a":1,"b":2}`, `{"method":1,"methods":2}`, `{"é":1,"e":2}`, `{"ß":1,"ss":2}`} {
		if _, ok := Object([]byte(in)); !ok {
			t.Errorf("Object(%s) = false, want true", in)
		}
	}
}
