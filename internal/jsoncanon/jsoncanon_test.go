package jsoncanon

import (
	"strings"
	"testing"
)

func TestAppend(t *testing.T) {
	deep := func(n int) string { return strings.Repeat("[", n) + strings.Repeat("]", n) }
	tests := []struct {
		name, in string
		want     string // "" when there is no canonical form
	}{
		{"scalar", ` 1 `, `1`},
		{"string kept", `"a\u0041\/"`, `"a\u0041\/"`},
		{"number spelling kept", `[1.0,1e2,-0]`, `[1.0,1e2,-0]`},
		{"literals", "[true,\tfalse,\nnull]", `[true,false,null]`},
		{"whitespace dropped", " { \"a\" : [ 1 , { } ] , \"b\" : \"x y\" } \r\n", `{"a":[1,{}],"b":"x y"}`},
		{"members sorted", `{"b":1,"a":2,"c":3}`, `{"a":2,"b":1,"c":3}`},
		{"nested members sorted", `{"z":[{"y":1,"x":2}],"a":{"d":{},"c":[]}}`, `{"a":{"c":[],"d":{}},"z":[{"x":2,"y":1}]}`},
		{"array order kept", `[3,1,2]`, `[3,1,2]`},
		{"sorted by decoded name", `{"b":1,"\u0061":2}`, `{"\u0061":2,"b":1}`},
		{"sorted bytewise", `{"é":1,"a":2,"Z":3}`, `{"Z":3,"a":2,"é":1}`},
		{"surrogate pair name", `{"\ud83d\ude00":1,"a":2}`, `{"a":2,"\ud83d\ude00":1}`},
		{"lone surrogate value kept", `{"a":"\ud800"}`, `{"a":"\ud800"}`},
		{"brace in string", `{"b":"}","a":"{\"}"}`, `{"a":"{\"}","b":"}"}`},
		{"depth 64", deep(64), deep(64)},

		{"repeated name", `{"a":1,"a":2}`, ""},
		{"repeated name escaped", `{"a":1,"\u0061":2}`, ""},
		{"repeated nested name", `[{"x":{"y":1,"y":1}}]`, ""},
		{"lone surrogate name", `{"\ud800":1}`, ""},
		{"reversed surrogates name", `{"\udc00\ud800":1}`, ""},
		{"too deep", deep(65), ""},
		{"invalid", `{"a":1`, ""},
		{"trailing data", `{} {}`, ""},
		{"empty", ``, ""},
		{"invalid utf-8", "\"\xff\"", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := Append([]byte("keep"), []byte(tt.in))
			if tt.want == "" {
				if ok || string(got) != "keep" {
					t.Errorf("Append(%q) = %q, %v; want dst unchanged, false", tt.in, got, ok)
				}
				return
			}
			if !ok || string(got) != "keep"+tt.want {
				t.Errorf("Append(%q) = %q, %v; want %q, true", tt.in, got, ok, "keep"+tt.want)
			}
		})
	}
}

func TestObject(t *testing.T) {
	tests := []struct {
		name, in string
		names    []string // nil when Object reports false
		values   []string // the canonical value of each member
	}{
		{"empty", ` {} `, []string{}, []string{}},
		{"sorted", "\n{\"b\": [1, 2], \"a\": {\"y\":1, \"x\":2}, \"c\":null}\n", []string{"a", "b", "c"}, []string{`{"x":2,"y":1}`, `[1,2]`, `null`}},
		{"decoded names", `{"m\u0065thod":"a","\ud83d\ude00":1,"q\"":2}`, []string{"method", "q\"", "\U0001F600"}, []string{`"a"`, `2`, `1`}},
		{"nested repeats left to the value", `{"a":{"x":1,"x":2},"b":1}`, []string{"a", "b"}, []string{"", `1`}},
		{"member value at depth 64", `{"a":` + strings.Repeat("[", 64) + strings.Repeat("]", 64) + `}`, []string{"a"}, []string{strings.Repeat("[", 64) + strings.Repeat("]", 64)}},
		{"nested too deep left to the value", `{"a":` + strings.Repeat("[", 65) + strings.Repeat("]", 65) + `}`, []string{"a"}, []string{""}},
		{"array", `[{"a":1}]`, nil, nil},
		{"string", `"{}"`, nil, nil},
		{"repeated name", `{"a":1,"b":2,"a":3}`, nil, nil},
		{"repeated escaped name", `{"\u0061":1,"a":2}`, nil, nil},
		{"lone surrogate name", `{"\udfff":1}`, nil, nil},
		{"invalid", `{"a":}`, nil, nil},
		{"trailing data", `{"a":1}x`, nil, nil},
		{"invalid utf-8", "{\"\xa2\":0,\"\x9e\":1}", nil, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			members, ok := Object([]byte(tt.in))
			if tt.names == nil {
				if ok || members != nil {
					t.Fatalf("Object(%q) = %v, %v; want nil, false", tt.in, members, ok)
				}
				return
			}
			if !ok || len(members) != len(tt.names) {
				t.Fatalf("Object(%q) = %v, %v; want %d members", tt.in, members, ok, len(tt.names))
			}
			for i, m := range members {
				if m.Name != tt.names[i] {
					t.Errorf("member %d: Name = %q, want %q", i, m.Name, tt.names[i])
				}
				got, ok := m.AppendValue([]byte("keep"))
				if want := tt.values[i]; want == "" {
					if ok || string(got) != "keep" {
						t.Errorf("member %q: AppendValue = %q, %v; want dst unchanged, false", m.Name, got, ok)
					}
				} else if !ok || string(got) != "keep"+want {
					t.Errorf("member %q: AppendValue = %q, %v; want %q", m.Name, got, ok, "keep"+want)
				}
			}
		})
	}
}
