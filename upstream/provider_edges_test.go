package upstream_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fakeprovider"
	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// TestProviderAnswerPasswordsNeverShown: the session list and the
// rotate answer carry the sessions' passwords. When such an answer is
// refused (one field of an unexpected type, a rotate call answered with an
// error status and the session object), the error quotes the start of the
// body with its credential fields redacted: the first session's password
// once went into the log, the provider status of the admin API
// (refresh.last_error) and the admin rotate call's error.
func TestProviderAnswerPasswordsNeverShown(t *testing.T) {
	const pw = "SESSIONPW-5e3a9"
	port := strings.Split(testkit.DeadAddr(t), ":")[1]
	good := `{"sessions": [{"id": "s1", "username": "u", "password": "` + pw + `", "gateway_host": "127.0.0.1", "http_port": ` + port + `}]}`
	// A provider that starts sending weight as a string: the list no longer parses.
	bad := `{"sessions": [{"id": "s1", "username": "u", "password": "` + pw + `", "gateway_host": "127.0.0.1", "http_port": ` + port + `, "weight": "5"}]}`
	var broken atomic.Bool
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch {
		case r.Method == http.MethodGet:
			if broken.Load() {
				w.Write([]byte(bad))
				return
			}
			w.Write([]byte(good))
		default: // rotate: refused, with the session object as the body
			w.WriteHeader(http.StatusConflict)
			w.Write([]byte(`{"id": "s1", "username": "u", "password": "` + pw + `", "error": "rotation cooldown"}`))
		}
	}))
	t.Cleanup(api.Close)
	logger, logs := testLogger(t)
	p := newPool(t, upstream.Config{Provider: upstream.ProviderConfig{API: api.URL, APIKey: "k"}}, logger)

	broken.Store(true)
	refreshErr := upstream.RefreshNow(context.Background(), p)
	rotateErr := p.Rotate(context.Background(), "s1")
	ps, _ := json.Marshal(p.Providers())
	for _, where := range []struct{ name, text string }{
		{"refresh error", errString(refreshErr)},
		{"admin rotate error", errString(rotateErr)},
		{"provider status (admin API)", string(ps)},
		{"log", logs.String()},
	} {
		if strings.Contains(where.text, pw) {
			t.Errorf("%s contains the session password:\n%s", where.name, where.text)
		}
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// TestRotateGarbageIsNoRotation: a rotate call answered 200 with a
// body that is not JSON at all (an overloaded front page, a captive
// portal: fakeprovider.APIGarbage) is counted as a rotation. The admin API
// says it worked, the session's rotation count and generation move, its
// pooled connections are dropped and the fleet is told of a new exit IP,
// while the provider did nothing: the session still exits from the old IP
// (the one that was rate-limited). The list call refuses the same answer.
func TestRotateGarbageIsNoRotation(t *testing.T) {
	fp := fakeprovider.Start(t, fakeprovider.Options{Sessions: 1})
	logger, _ := testLogger(t)
	p := newPool(t, providerConfig(fp), logger)
	before := exitIP(t, fp, "s1")
	fp.SetAPIMode(fakeprovider.APIGarbage)
	err := p.Rotate(context.Background(), "s1")
	if fp.Rotations("s1") != 0 || exitIP(t, fp, "s1") != before {
		t.Fatal("the fake provider rotated after all; test is moot")
	}
	if err == nil {
		t.Errorf("Rotate reported success for an HTML answer; the session still exits from %s", before)
	}
	var se *upstream.StatusError
	if err != nil && (!errors.As(err, &se) || se.Status != http.StatusBadGateway) {
		t.Errorf("Rotate error %v, want a 502 StatusError", err)
	}
	if st := statusOf(t, p, "s1"); st.Rotations != 0 {
		t.Errorf("session shows %d rotations, the provider made none", st.Rotations)
	}
}

// TestHealthProbesSpareABenchedGateway: RoProxy-style providers put
// every session behind one gateway address (credentials tell them apart).
// Once that address refuses connections the pool benches the gateway and
// every session behind it at once (provider.gateway), so that requests do
// not try them one by one. The health loop probes a benched gateway
// through one canary session a round, not through each of them (it dialed
// the dead gateway once per session and round, and every refusal was one
// more strike that doubled the benching).
func TestHealthProbesSpareABenchedGateway(t *testing.T) {
	const sessions = 12
	port := strings.Split(testkit.DeadAddr(t), ":")[1]
	var list []string
	for i := range sessions {
		list = append(list, `{"id": "s`+strconv.Itoa(i)+`", "username": "u`+strconv.Itoa(i)+`", "password": "pw", "gateway_host": "127.0.0.1", "http_port": `+port+`}`)
	}
	api := startScriptedAPI(t, `{"sessions": [`+strings.Join(list, ",")+`]}`)
	o := newOrigin(t, false)
	logger, _ := testLogger(t)
	p := newPool(t, upstream.Config{
		Provider: upstream.ProviderConfig{API: api.URL, APIKey: "k"},
		Health:   upstream.HealthConfig{URL: o.URL, Interval: 30 * time.Millisecond, Timeout: time.Second},
	}, logger)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- p.Run(ctx) }()
	time.Sleep(400 * time.Millisecond)
	cancel()
	<-done
	var probes int64
	for _, s := range p.Sessions() {
		probes += s.Requests
	}
	var benched bool
	for _, ps := range p.Providers() {
		benched = benched || len(ps.Gateways) > 0
	}
	if !benched {
		t.Fatal("the dead gateway was never benched; test is moot")
	}
	// ~13 rounds in 400ms; one probe per round of the benched gateway
	// would be ~13, one per session ~156.
	if probes > 3*sessions {
		t.Errorf("%d connection attempts to one benched gateway in 400ms of health rounds (%d sessions behind it)", probes, sessions)
	}
}

// TestBrokenListJSONPasswordsNeverShown: a session list that is not JSON
// at all, one trailing comma or a body cut short, cannot be re-encoded
// with its credential fields redacted. Its start was quoted as it came,
// with the first session's password, into the log and the provider
// status of the admin API (refresh.last_error).
func TestBrokenListJSONPasswordsNeverShown(t *testing.T) {
	const pw = "SESSIONPW-91c2e"
	for _, body := range []string{
		`{"sessions": [{"id": "s1", "username": "u", "password": "` + pw + `", "http_port": 1,}]}`,
		`{"sessions": [{"id": "s1", "username": "u", "password": "` + pw,
		`{"sessions": [{"id": "s1", "user": "u", 'pass': "x", "api_key": "` + pw + `"`,
	} {
		api := startScriptedAPI(t, body)
		logger, logs := testLogger(t)
		p := newPool(t, upstream.Config{Provider: upstream.ProviderConfig{API: api.URL, APIKey: "k"}}, logger)
		err := upstream.RefreshNow(context.Background(), p)
		if err == nil {
			t.Fatalf("list %s accepted", body)
		}
		ps, _ := json.Marshal(p.Providers())
		for _, where := range []struct{ name, text string }{
			{"refresh error", err.Error()},
			{"provider status (admin API)", string(ps)},
			{"log", logs.String()},
		} {
			if strings.Contains(where.text, pw) {
				t.Errorf("list %s: %s contains the session password:\n%s", body, where.name, where.text)
			}
		}
	}
}
