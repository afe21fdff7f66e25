package bytesize

import (
	"testing"

	"go.yaml.in/yaml/v3"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Size
		ok   bool
	}{
		{"1048576", MiB, true},
		{"8MiB", 8 * MiB, true},
		{"64 KiB", 64 * KiB, true},
		{"512KB", 512000, true},
		{"2GB", 2e9, true},
		{"1GiB", GiB, true},
		{"10B", 10, true},
		{"", 0, false},
		{"-1", 0, false},
		{"8 megs", 0, false},
		{"1.5MiB", 0, false},
		{"99999999999GiB", 0, false},
	} {
		got, err := Parse(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("Parse(%q) = %d, %v; want %d ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

func TestYAMLRoundTrip(t *testing.T) {
	var v struct {
		A Size `yaml:"a"`
		B Size `yaml:"b"`
	}
	if err := yaml.Unmarshal([]byte("a: 8MiB\nb: 1500\n"), &v); err != nil {
		t.Fatal(err)
	}
	if v.A != 8*MiB || v.B != 1500 {
		t.Fatalf("got %+v", v)
	}
	out, _ := yaml.Marshal(v)
	if string(out) != "a: 8MiB\nb: 1500B\n" {
		t.Fatalf("marshal: %q", out)
	}
	if err := yaml.Unmarshal([]byte("a: lots\n"), &v); err == nil {
		t.Fatal("bad size accepted")
	}
}
