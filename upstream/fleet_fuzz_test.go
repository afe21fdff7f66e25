package upstream

import (
	"encoding/json"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
)

// FuzzSessionNote feeds arbitrary notes, live and recalled, to the decoder
// and applies what it accepts, with no recover in between: a panic fails
// the fuzzer. What the decoder accepts must also be something the pool can
// act on, and must survive a round trip.
func FuzzSessionNote(f *testing.F) {
	for _, seed := range []string{
		`{"session":"s1","kind":"cooldown","for":60000000000,"reason":"rate_limited"}`,
		`{"session":"s1","kind":"cooldown","for":60000000000,"reason":"bogus"}`,
		`{"session":"s1","kind":"rotated","exit_ip":"127.0.0.7"}`,
		`{"session":"eu-1.x","kind":"rotated"}`,
		`{"session":"s1","kind":"cooldown","for":-1,"reason":"banned"}`,
		`[]`, `null`, `{`,
	} {
		f.Add(seed, int64(0))
		f.Add(seed, int64(time.Minute))
	}
	p, err := New(Config{Sessions: []SessionConfig{{ID: "s1", URL: "http://127.0.0.1:9"}}},
		slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, msg string, left int64) {
		ev, err := decodeSessionEvent(msg, time.Duration(left))
		if err != nil {
			return
		}
		if clientinfo.ValidateSessionID(ev.Session) != nil {
			t.Fatalf("accepted session id %q", ev.Session)
		}
		switch ev.Kind {
		case EventCooldown:
			o, ok := parseOutcome(ev.Reason)
			if !ok || !o.failure() || ev.For <= 0 || ev.For > maxRetryAfter {
				t.Fatalf("accepted cooldown %+v", ev)
			}
		case EventRotated:
		default:
			t.Fatalf("accepted kind %q", ev.Kind)
		}
		b, err := json.Marshal(ev)
		if err != nil {
			t.Fatal(err)
		}
		again, err := decodeSessionEvent(string(b), 0)
		if err != nil || again != ev {
			t.Fatalf("round trip of %+v: %+v, %v", ev, again, err)
		}
		p.applySessionEvent(ev)
	})
}
