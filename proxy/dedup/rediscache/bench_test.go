package rediscache

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/redistest"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// BenchmarkFleetMiss measures the fleet layer of one miss alone: a Join
// that leads and a Finish that stores a 2 KiB text body, from 32
// goroutines, against a private redis-server. It reports what a miss
// costs this process (client-cpu-µs/op, from getrusage: go-redis, the
// batcher, the codec, the memory tier) and what it costs Redis
// (redis-cpu-µs/op, from INFO's used_cpu_*), and the commands and round
// trips Redis counted. Run it alone:
//
//	go test -run '^$' -bench FleetMiss -benchtime 30000x ./proxy/dedup/rediscache/
func BenchmarkFleetMiss(b *testing.B) {
	srv := redistest.Start(b)
	cfg := Config{URL: srv.URL, StatsFlush: time.Hour}
	local := dedup.NewMemoryStore(256 << 20)
	b.Cleanup(local.Close)
	be, err := Open(cfg, local, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); be.Run(ctx) }()
	b.Cleanup(func() { cancel(); <-done; be.Close() })
	st := be.Cache
	body := []byte(strings.Repeat("<p>a page of text, as an origin serves it</p>\n", 2048/46+1)[:2048])
	var seq atomic.Int64
	miss := func(ctx context.Context) error {
		n := seq.Add(1)
		key := fmt.Sprintf("GET https://bench.test/u/%d", n)
		l, out, err := st.Join(ctx, key)
		if err != nil {
			return err
		}
		if out != nil || l == nil {
			return fmt.Errorf("%s: not led (outcome %+v)", key, out)
		}
		h := http.Header{"Content-Type": {"text/html"}, "Date": {time.Now().UTC().Format(http.TimeFormat)}}
		e := &dedup.Entry{Status: 200, Header: h, Body: body, StoredAt: time.Now(), ExpiresAt: time.Now().Add(time.Minute), URLKey: "https://bench.test/u/" + strconv.FormatInt(n, 10)}
		return l.Finish(ctx, dedup.Outcome{Entry: e}, time.Minute)
	}
	// Load the scripts (the first EVALSHA answers NOSCRIPT).
	if err := miss(ctx); err != nil {
		b.Fatal(err)
	}
	before, cpuBefore := srv.Stats(), selfCPU()
	b.SetParallelism(16) // 32 goroutines on 2 cores, as BenchmarkStores' clients
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := miss(ctx); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.StopTimer()
	after, cpuAfter := srv.Stats(), selfCPU()
	per := func(v float64) float64 { return v / float64(b.N) }
	b.ReportMetric(per((cpuAfter-cpuBefore).Seconds()*1e6), "client-cpu-µs/op")
	b.ReportMetric(per((after.CPU-before.CPU).Seconds()*1e6), "redis-cpu-µs/op")
	b.ReportMetric(per(float64(after.Commands-before.Commands)), "cmds/op")
	b.ReportMetric(per(float64(after.Reads-before.Reads)), "rtt/op")
}

// selfCPU is the CPU time this process has used, user and system.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
