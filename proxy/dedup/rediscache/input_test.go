package rediscache

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/seed-a3c387e8/onceproxy/internal/redistest"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// TestHostileEventsAreIgnored: whatever lands on the events channel or in
// the lasting notes (another version, a person with redis-cli) is counted
// and ignored; the instance keeps serving and keeps hearing good notes.
func TestHostileEventsAreIgnored(t *testing.T) {
	f := newFleet(t, 1, Config{}, dedup.Config{}, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "page") })
	inst := f.insts[0]
	var heard []string
	var heardMu = make(chan struct{}, 1)
	heardMu <- struct{}{}
	inst.bus.Subscribe("session", func(msg string, _ time.Duration) {
		<-heardMu
		heard = append(heard, msg)
		heardMu <- struct{}{}
	})
	opts, err := redis.ParseURL(f.redis.URL)
	if err != nil {
		t.Fatal(err)
	}
	rc := redis.NewClient(opts)
	defer rc.Close()
	ctx := context.Background()
	channel := inst.be.c.channel
	garbage := []string{"", "x", "d", "d ", "zz top", "n", "n onlyinstance", "n other", "n other session", "\x00\xff"}
	good := `{"session":"s1","kind":"rotated"}`
	testkit.Eventually(t, testkit.Patience, func() bool {
		rc.Publish(ctx, channel, "n other session "+good)
		time.Sleep(20 * time.Millisecond)
		<-heardMu
		defer func() { heardMu <- struct{}{} }()
		return len(heard) > 0
	}, "the subscription to hear a good note")
	before := inst.be.Rejected()
	for _, g := range garbage {
		if err := rc.Publish(ctx, channel, g).Err(); err != nil {
			t.Fatal(err)
		}
	}
	testkit.Eventually(t, testkit.Patience, func() bool {
		return inst.be.Rejected()-before == int64(len(garbage))
	}, "every garbage event to be counted")
	if g := inst.get(f.origin.URL + "/after"); g.status != 200 || g.body != "page" {
		t.Fatalf("after garbage events: %+v", g)
	}

	// Lasting notes in Redis's hash that onceproxy did not write: the
	// unreadable ones are dropped, the ones that claim to last for ever are
	// counted and ignored, the good one is recalled.
	key := inst.bus.lastingKey("session")
	rc.HSet(ctx, key, "a", "garbage", "b", "99999999999999999 forever", "c", fmt.Sprintf("%d %s", time.Now().Add(time.Hour).UnixMilli(), good))
	var recalledMsgs []string
	inst.bus.Subscribe("session", func(msg string, left time.Duration) {
		if left > 0 {
			recalledMsgs = append(recalledMsgs, msg)
		}
	})
	if len(recalledMsgs) != 1 || recalledMsgs[0] != good {
		t.Errorf("recalled %q, want only the good note", recalledMsgs)
	}
}

// FuzzEvent feeds arbitrary events to the dispatcher with no recover in
// between: a panic fails the fuzzer. An event is either used or counted
// as rejected, never both and never neither.
func FuzzEvent(f *testing.F) {
	for _, s := range []string{"d abc", "i abc", "u v1:abc", "n other session {}", "n me session x", "n", "q q", ""} {
		f.Add(s)
	}
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	c := &client{log: logger, instance: "me", prefix: "t:v1:"}
	c.life, c.cancel = context.WithCancel(context.Background())
	defer c.cancel()
	local := dedup.NewMemoryStore(1 << 20)
	defer local.Close()
	b := &Backend{c: c, Cache: newCache(c, local), Bus: &Bus{client: c}}
	var delivered int
	b.Bus.topics.Set("session", func(string, time.Duration) { delivered++ })
	f.Fuzz(func(t *testing.T, payload string) {
		before, rejected := delivered, c.rejected.Load()
		b.handleEventUnguarded(payload)
		used := delivered > before
		kind, arg, ok := strings.Cut(payload, " ")
		wellFormed := ok && arg != "" && (kind == "d" || kind == "i" || kind == "u" || kind == "n")
		if c.rejected.Load() > rejected && used {
			t.Fatalf("%q was both delivered and rejected", payload)
		}
		if !wellFormed && c.rejected.Load() == rejected {
			t.Fatalf("%q was not rejected", payload)
		}
	})
}

// FuzzRecalledNotes: the recall script's reply, as another version could
// shape it. What is accepted has a positive, bounded time left.
func FuzzRecalledNotes(f *testing.F) {
	f.Add("msg", int64(1000), "other", int64(-1), true)
	f.Fuzz(func(t *testing.T, m1 string, ms1 int64, m2 string, ms2 int64, odd bool) {
		res := []any{m1, ms1, m2, ms2}
		if odd {
			res = append(res, "dangling")
		}
		out, bad := recalledNotes(res)
		if len(out)+bad != len(res)/2+len(res)%2 {
			t.Fatalf("%v: %d accepted + %d bad", res, len(out), bad)
		}
		for _, n := range out {
			if n.left <= 0 || n.left > maxLasting {
				t.Fatalf("accepted %+v", n)
			}
		}
	})
}

// TestUnreadableValuesAreCounted: a value this build cannot read (another
// version's, garbage) is counted as rejected input, on the way to a flight
// (Join removes it and leads) and on a plain read (Get answers "absent").
// Both used to drop it without a word, so that two builds of a rolling
// upgrade could delete each other's values unseen.
func TestUnreadableValuesAreCounted(t *testing.T) {
	srv := redistest.Start(t)
	be := openBackend(t, srv)
	ctx := t.Context()
	rdb := srv.Client()
	for i, read := range []func(key string) error{
		func(key string) error {
			l, out, err := be.Cache.Join(ctx, key)
			if err != nil || out != nil || l == nil {
				return fmt.Errorf("Join = %v, %+v, %v; want the lease", l, out, err)
			}
			l.Release()
			return nil
		},
		func(key string) error {
			if _, err := be.Cache.Get(ctx, key); err != dedup.ErrNotFound {
				return fmt.Errorf("Get: %v, want ErrNotFound", err)
			}
			return nil
		},
	} {
		key := fmt.Sprintf("GET https://unreadable.test/%d", i)
		if err := rdb.Set(ctx, be.c.valueKey(tagOf(key)), "a value from a newer version", time.Hour).Err(); err != nil {
			t.Fatal(err)
		}
		before := be.Rejected()
		if err := read(key); err != nil {
			t.Fatalf("read %d: %v", i, err)
		}
		if got := be.Rejected(); got != before+1 {
			t.Errorf("read %d: rejected %d, then %d; want one more", i, before, got)
		}
	}
}

// openBackend opens a Backend on srv, closed with the test.
func openBackend(t *testing.T, srv *redistest.Server) *Backend {
	t.Helper()
	local := dedup.NewMemoryStore(16 << 20)
	t.Cleanup(local.Close)
	be, err := Open(Config{URL: srv.URL}, local, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	return be
}

// TestURLIndexOutlivesEveryVariant: variants of one URL kept for different
// TTLs (rules that differ by method, say) stay listed for invalidation by
// URL as long as each lives, whatever order they were stored in. With one
// index set per URL, a variant kept for a second, stored after one kept for
// an hour, cut the set's life to a minute and a second: after that the
// hour's variant was out of reach of InvalidateURL.
func TestURLIndexOutlivesEveryVariant(t *testing.T) {
	srv := redistest.Start(t)
	be := openBackend(t, srv)
	ctx := t.Context()
	rdb := srv.Client()
	const urlKey = "https://ttl.test/page"
	variants := []struct {
		key string
		ttl time.Duration
	}{
		{"GET https://ttl.test/page#long", time.Hour},
		{"HEAD https://ttl.test/page#short", time.Second},
		{"GET https://ttl.test/page#mid", 45 * time.Second},
	}
	for _, v := range variants {
		e := &dedup.Entry{Status: 200, Body: []byte(v.key), URLKey: urlKey}
		if err := be.Cache.Set(ctx, v.key, e, v.ttl); err != nil {
			t.Fatal(err)
		}
	}
	// Every index set of the URL, with what it lists and how long it lives.
	sets, err := rdb.Keys(ctx, be.c.urlKey(urlKey)+"*").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range variants {
		tag := tagOf(v.key)
		lives := rdb.PTTL(ctx, be.c.valueKey(tag)).Val()
		listed := false
		for _, k := range sets {
			if rdb.SIsMember(ctx, k, tag).Val() && rdb.PTTL(ctx, k).Val() >= lives {
				listed = true
			}
		}
		if !listed {
			t.Errorf("%s (kept %s): no index set lists it for as long as it lives (sets %v)", v.key, v.ttl, sets)
		}
	}
	// A variant an instance of the version before indexed, in its one set
	// per URL: found too, during a rolling upgrade.
	old := tagOf("GET https://ttl.test/page#old")
	if err := rdb.Set(ctx, be.c.valueKey(old), "a value", time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.SAdd(ctx, be.c.urlKey(urlKey), old).Err(); err != nil {
		t.Fatal(err)
	}
	n, err := be.Cache.DeleteURL(ctx, urlKey)
	if err != nil || n != len(variants)+1 {
		t.Fatalf("DeleteURL = %d, %v; want the %d variants", n, err, len(variants)+1)
	}
	if left, _ := rdb.Keys(ctx, be.c.urlKey(urlKey)+"*").Result(); len(left) != 0 {
		t.Errorf("index sets left after DeleteURL: %v", left)
	}
}
