package mitm

import (
	"strings"
	"testing"
	"time"
)

func TestWithDefaults(t *testing.T) {
	got := Config{}.WithDefaults()
	want := Config{CADir: "certs", LeafValidity: 168 * time.Hour, CacheSize: 10000}
	if got != want {
		t.Errorf("Config{}.WithDefaults() = %+v, want %+v", got, want)
	}

	set := Config{CADir: "/var/lib/onceproxy", LeafValidity: 2 * time.Hour, CacheSize: 5}
	if got := set.WithDefaults(); got != set {
		t.Errorf("WithDefaults() changed set fields: got %+v, want %+v", got, set)
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		want []string // substrings, one per expected error line; nil means valid
	}{
		{name: "zero means defaults", cfg: Config{}},
		{name: "defaults", cfg: Config{}.WithDefaults()},
		{name: "lower bound", cfg: Config{LeafValidity: time.Hour, CacheSize: 1}},
		{name: "upper bound", cfg: Config{LeafValidity: 397 * 24 * time.Hour}},
		{
			name: "leaf validity too short",
			cfg:  Config{LeafValidity: 10 * time.Minute},
			want: []string{"leaf_validity: must be at least 1h, got 10m"},
		},
		{
			name: "leaf validity negative",
			cfg:  Config{LeafValidity: -2 * time.Hour},
			want: []string{"leaf_validity: must be at least 1h, got -2h"},
		},
		{
			name: "leaf validity too long",
			cfg:  Config{LeafValidity: 398 * 24 * time.Hour},
			want: []string{"leaf_validity: must be at most 397 days (9528h), got 9552h"},
		},
		{
			name: "cache size negative",
			cfg:  Config{CacheSize: -1},
			want: []string{"cert_cache_size: must be at least 1, got -1"},
		},
		{
			name: "ca dir with NUL",
			cfg:  Config{CADir: "certs\x00"},
			want: []string{"ca_dir: must not contain a NUL byte"},
		},
		{
			name: "every problem at once",
			cfg:  Config{CADir: "a\x00b", LeafValidity: time.Second, CacheSize: -7},
			want: []string{
				"ca_dir: must not contain a NUL byte",
				"leaf_validity: must be at least 1h, got 1s",
				"cert_cache_size: must be at least 1, got -7",
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			if tt.want == nil {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate() = nil, want %q", tt.want)
			}
			lines := strings.Split(err.Error(), "\n")
			if len(lines) != len(tt.want) {
				t.Fatalf("Validate() reported %d problems, want %d:\n%v", len(lines), len(tt.want), err)
			}
			for i, w := range tt.want {
				if lines[i] != w {
					t.Errorf("problem %d = %q, want %q", i, lines[i], w)
				}
			}
		})
	}
}

func TestLoadOrCreateRejectsInvalidConfig(t *testing.T) {
	_, err := LoadOrCreate(Config{CADir: t.TempDir(), LeafValidity: time.Minute}, nil)
	if err == nil || !strings.Contains(err.Error(), "leaf_validity") {
		t.Fatalf("LoadOrCreate(bad config) = %v, want a leaf_validity error", err)
	}
}
