package app

import (
	"strings"
	"testing"
)

// TestOneSharedStore: Redis and PostgreSQL together is a start-up error
// naming both keys; the conventional variables fill the store only when
// none is configured, and both of them at once is an error too.
func TestOneSharedStore(t *testing.T) {
	for _, tc := range []struct {
		name    string
		env     []string
		wantErr []string
		redis   string
		pg      string
	}{
		{name: "both keys", env: []string{"ONCEPROXY_REDIS_URL=redis://127.0.0.1:6379/0", "ONCEPROXY_POSTGRES_URL=postgres://127.0.0.1/db"},
			wantErr: []string{"postgres.url", "redis.url"}},
		{name: "cluster and postgres", env: []string{"ONCEPROXY_REDIS_ADDRS=[127.0.0.1:7000]", "ONCEPROXY_POSTGRES_URL=postgres://127.0.0.1/db"},
			wantErr: []string{"postgres.url", "redis.addrs"}},
		{name: "DATABASE_URL", env: []string{"DATABASE_URL=postgres://127.0.0.1/db"}, pg: "postgres://127.0.0.1/db"},
		{name: "REDIS_URL", env: []string{"REDIS_URL=redis://127.0.0.1:6379/0"}, redis: "redis://127.0.0.1:6379/0"},
		{name: "both variables", env: []string{"REDIS_URL=redis://127.0.0.1:6379/0", "DATABASE_URL=postgres://127.0.0.1/db"},
			wantErr: []string{"REDIS_URL and DATABASE_URL", "redis.url or postgres.url"}},
		{name: "a key wins over the other store's variable", env: []string{"ONCEPROXY_POSTGRES_URL=postgres://127.0.0.1/db", "REDIS_URL=redis://127.0.0.1:6379/0"},
			pg: "postgres://127.0.0.1/db"},
		{name: "and the other way", env: []string{"ONCEPROXY_REDIS_URL=redis://127.0.0.1:6379/0", "DATABASE_URL=postgres://127.0.0.1/db"},
			redis: "redis://127.0.0.1:6379/0"},
		{name: "bad schema", env: []string{"ONCEPROXY_POSTGRES_URL=postgres://127.0.0.1/db", "ONCEPROXY_POSTGRES_SCHEMA=Bad-Name"},
			wantErr: []string{"postgres.schema:"}},
		{name: "budget", env: []string{"ONCEPROXY_POSTGRES_URL=postgres://127.0.0.1/db", "ONCEPROXY_POSTGRES_MAX_CONNS=4", "ONCEPROXY_POSTGRES_FLIGHT_CONNS=3"},
			wantErr: []string{"postgres.max_conns: must be at least flight_conns + 2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := LoadConfig(shippedConfig, "", tc.env)
			if len(tc.wantErr) > 0 {
				if err == nil {
					t.Fatal("accepted")
				}
				for _, want := range tc.wantErr {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("error %q lacks %q", err, want)
					}
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if cfg.Redis.URL != tc.redis || cfg.Postgres.URL != tc.pg {
				t.Fatalf("redis.url %q, postgres.url %q; want %q, %q", cfg.Redis.URL, cfg.Postgres.URL, tc.redis, tc.pg)
			}
		})
	}
}
