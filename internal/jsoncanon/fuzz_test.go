package jsoncanon

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

func FuzzCanonJSON(f *testing.F) {
	for _, s := range []string{
		`{}`, `[]`, `1`, `"a"`, `null`, `{"b":1,"a":[true,false,null,{"d":{},"c":[]}]}`,
		` { "a" : "x\"}" , "b\\" : -1.5e+10 } `, `{"a":1,"a":2}`, `{"\u0061":1,"a":2}`,
		`{"\ud83d\ude00":"\ud800"}`, `[[[[[[[[[[{"z":1}]]]]]]]]]]`, `{"a":"\u00e9","é":1}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		checkObject(t, data)
		got, ok := Append(nil, data)
		if !ok {
			return
		}
		if !json.Valid(got) {
			t.Fatalf("Append(%q) = %q, not valid JSON", data, got)
		}
		if want, have := decode(t, data), decode(t, got); !reflect.DeepEqual(want, have) {
			t.Fatalf("Append(%q) = %q changes the value: %#v vs %#v", data, got, want, have)
		}
		again, ok := Append(nil, got)
		if !ok || !bytes.Equal(again, got) {
			t.Fatalf("Append not idempotent: %q -> %q -> %q (%v)", data, got, again, ok)
		}
	})
}

// checkObject holds Object to encoding/json: when Object accepts data, it
// has the names encoding/json decodes, once each and sorted, and each
// member's canonical value decodes to the same value as the original.
func checkObject(t *testing.T, data []byte) {
	t.Helper()
	members, ok := Object(data)
	if !ok {
		return
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(data, &m); err != nil {
		t.Fatalf("Object(%q) accepted what encoding/json rejects: %v", data, err)
	}
	if len(members) != len(m) {
		t.Fatalf("Object(%q) has %d members, encoding/json %d", data, len(members), len(m))
	}
	for i, mem := range members {
		if i > 0 && strings.Compare(members[i-1].Name, mem.Name) >= 0 {
			t.Fatalf("Object(%q): members not sorted: %q before %q", data, members[i-1].Name, mem.Name)
		}
		raw, found := m[mem.Name]
		if !found {
			t.Fatalf("Object(%q): member %q unknown to encoding/json", data, mem.Name)
		}
		if v, ok := mem.AppendValue(nil); ok && !reflect.DeepEqual(decode(t, raw), decode(t, v)) {
			t.Fatalf("Object(%q): member %q canonical value %q changes %q", data, mem.Name, v, raw)
		}
	}
}

// decode decodes one JSON value, numbers as json.Number so that no
// spelling is lost to float64.
func decode(t *testing.T, data []byte) any {
	t.Helper()
	var v any
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("decode %q: %v", data, err)
	}
	return v
}
