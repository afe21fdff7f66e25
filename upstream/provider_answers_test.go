package upstream_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/testkit"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// scriptedAPI is a provider API on loopback that answers what the test
// sets: the session list and the rotate call's body.
type scriptedAPI struct {
	*httptest.Server
	mu     sync.Mutex
	list   string
	rotate string
}

func startScriptedAPI(t *testing.T, list string) *scriptedAPI {
	t.Helper()
	a := &scriptedAPI{list: list, rotate: "{}"}
	a.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a.mu.Lock()
		list, rotate := a.list, a.rotate
		a.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		switch {
		case r.Method == http.MethodGet && r.URL.Path == "/api/session":
			io.WriteString(w, list)
		case r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/rotate"):
			io.WriteString(w, rotate)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(a.Close)
	return a
}

func (a *scriptedAPI) setRotate(body string) {
	a.mu.Lock()
	a.rotate = body
	a.mu.Unlock()
}

// TestProviderExitIPMustBeAnAddress: exit_ip is what the provider says,
// and providers say odd things ("pending", "ip:port", a trailing newline).
// What is not an IP address is unknown: it is neither shown as the exit IP
// nor sent to the fleet, where a rotation note carrying it was rejected
// whole, so the other instances kept their tunnels to the old exit IP. An
// address with blanks around it is the address.
func TestProviderExitIPMustBeAnAddress(t *testing.T) {
	api := startScriptedAPI(t, `{"sessions": [{"id": "s1", "username": "u", "password": "pw",
		"gateway_host": "127.0.0.1", "http_port": `+strings.Split(testkit.DeadAddr(t), ":")[1]+`,
		"exit_ip": "203.0.113.7:31280"}]}`)
	a, b, _ := twoInstances(t, upstream.Config{Provider: upstream.ProviderConfig{API: api.URL, APIKey: "k"}})
	if st := statusOf(t, a, "s1"); st.ExitIP != "" {
		t.Errorf("listed exit_ip %q shown as %q, want unknown", "203.0.113.7:31280", st.ExitIP)
	}

	api.setRotate(`{"id": "s1", "exit_ip": "pending"}`)
	if err := a.Rotate(context.Background(), "s1"); err != nil {
		t.Fatal(err)
	}
	if n := b.NotesRejected(); n != 0 {
		t.Fatalf("the other instance rejected %d rotation notes", n)
	}
	if st := statusOf(t, a, "s1"); st.ExitIP != "" || st.Rotations != 1 {
		t.Errorf("after a rotation to %q: %+v", "pending", st)
	}

	api.setRotate(`{"id": "s1", "exit_ip": " 203.0.113.9\n"}`)
	if err := a.Rotate(context.Background(), "s1"); err != nil {
		t.Fatal(err)
	}
	if n := b.NotesRejected(); n != 0 {
		t.Fatalf("the other instance rejected %d rotation notes", n)
	}
	for _, p := range []*upstream.Pool{a, b} {
		if st := statusOf(t, p, "s1"); st.ExitIP != "203.0.113.9" {
			t.Errorf("exit IP %q, want 203.0.113.9", st.ExitIP)
		}
	}
}

// TestProviderAPIRetryAfterHonoured: a provider API that rate-limits the
// list call says when to call again (429 with Retry-After). The refresh
// loop retried on its own schedule instead (5s, then doubling, or every
// refresh interval when shorter), calling a rate-limited API again and
// again, which only keeps it limiting: a fleet of instances did so each.
func TestProviderAPIRetryAfterHonoured(t *testing.T) {
	port := strings.Split(testkit.DeadAddr(t), ":")[1]
	list := `{"sessions": [{"id": "s1", "username": "u", "password": "pw", "gateway_host": "127.0.0.1", "http_port": ` + port + `}]}`
	var calls atomic.Int64
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			io.WriteString(w, list)
			return
		}
		w.Header().Set("Retry-After", "30")
		http.Error(w, `{"error": "rate limited"}`, http.StatusTooManyRequests)
	}))
	t.Cleanup(api.Close)
	logger, _ := testLogger(t)
	p := newPool(t, upstream.Config{Provider: upstream.ProviderConfig{API: api.URL, APIKey: "k", Refresh: 50 * time.Millisecond}}, logger)
	runPool(t, p)
	testkit.Eventually(t, testkit.Patience, func() bool { return calls.Load() >= 2 }, "a refresh answered 429")
	time.Sleep(500 * time.Millisecond)
	if n := calls.Load() - 2; n > 0 {
		t.Errorf("%d more list calls within 500ms of a 429 with Retry-After: 30", n)
	}
}

// TestProviderGatewayHostMustBeAHost: gateway_host is where the sessions'
// traffic and credentials go. One that is neither a host name nor an IP
// address ("gw.example:8000" with its port, "[::1]" in brackets, an empty
// label) was taken as it came: the list was accepted, and every request
// through its sessions failed at the dial ("lookup 127.0.0.1:5555: no such
// host") and benched them one by one. It is an invalid entry, and the
// list is refused whole, as for any other: the pool keeps the one it had.
func TestProviderGatewayHostMustBeAHost(t *testing.T) {
	port := strings.Split(testkit.DeadAddr(t), ":")[1]
	entry := func(host string) string {
		return `{"sessions": [{"id": "s1", "username": "u", "password": "pw", "gateway_host": "` + host + `", "http_port": ` + port + `}]}`
	}
	api := startScriptedAPI(t, entry("127.0.0.1"))
	logger, _ := testLogger(t)
	p := newPool(t, upstream.Config{Provider: upstream.ProviderConfig{API: api.URL, APIKey: "k"}}, logger)
	for _, host := range []string{"127.0.0.1:5555", "gw.example:8000", "[::1]", "gw..example", "gw.example%00"} {
		api.mu.Lock()
		api.list = entry(host)
		api.mu.Unlock()
		err := upstream.RefreshNow(context.Background(), p)
		if err == nil || !strings.Contains(err.Error(), "gateway_host") {
			t.Errorf("gateway_host %q: refresh error %v, want the entry refused", host, err)
		}
		if st := statusOf(t, p, "s1"); st.Proxy != "http://xxxxx:xxxxx@127.0.0.1:"+port {
			t.Errorf("gateway_host %q: session s1 now goes through %s", host, st.Proxy)
		}
	}
	api.mu.Lock()
	api.list = entry("::1")
	api.mu.Unlock()
	if err := upstream.RefreshNow(context.Background(), p); err != nil {
		t.Errorf("gateway_host ::1 refused: %v", err)
	}
}

// TestSOCKS5CredentialsFitRFC1929: a SOCKS5 gateway takes a user name and
// a password of at most 255 bytes each (RFC 1929). Longer ones (a token
// as the password) were accepted, from the provider's list and from the
// configuration, and every connection through the session then failed
// before it left this host ("invalid username/password"), charged to the
// session as a connection error. They are refused where they are read.
func TestSOCKS5CredentialsFitRFC1929(t *testing.T) {
	long := strings.Repeat("p", 256)
	port := strings.Split(testkit.DeadAddr(t), ":")[1]
	api := startScriptedAPI(t, `{"sessions": [{"id": "s1", "username": "u", "password": "`+long+`", "gateway_host": "127.0.0.1", "socks5_port": `+port+`}]}`)
	logger, _ := testLogger(t)
	p := newPool(t, upstream.Config{Provider: upstream.ProviderConfig{API: api.URL, APIKey: "k", Protocol: "socks5"}}, logger)
	if err := upstream.RefreshNow(context.Background(), p); err == nil || !strings.Contains(err.Error(), "255") {
		t.Errorf("a listed SOCKS5 session with a %d-byte password: refresh error %v, want it refused", len(long), err)
	}
	if _, err := upstream.New(upstream.Config{URL: "socks5://u:" + long + "@127.0.0.1:" + port}, logger); err == nil || !strings.Contains(err.Error(), "255") {
		t.Errorf("a configured SOCKS5 session with a %d-byte password: New error %v, want it refused", len(long), err)
	} else if strings.Contains(err.Error(), long) {
		t.Errorf("the error shows the password: %v", err)
	}
}

// TestRotateAnyJSONIsARotation: a 2xx to the rotate call whose body is
// JSON counts as a rotation, exit_ip or not (README); only a body that is
// not JSON at all is no word from the provider. A JSON answer of another
// shape (exit_ip a number, an array, a bare "ok") failed to decode into
// the session object and was taken for a failed rotation: the admin API
// answered 502, and after a 429 the session kept its pooled connections
// to the old exit IP while the provider had moved it.
func TestRotateAnyJSONIsARotation(t *testing.T) {
	port := strings.Split(testkit.DeadAddr(t), ":")[1]
	api := startScriptedAPI(t, `{"sessions": [{"id": "s1", "username": "u", "password": "pw", "gateway_host": "127.0.0.1", "http_port": `+port+`}]}`)
	logger, _ := testLogger(t)
	p := newPool(t, upstream.Config{Provider: upstream.ProviderConfig{API: api.URL, APIKey: "k"}}, logger)
	for i, body := range []string{`{"exit_ip": 2130706434}`, `["rotated"]`, `"ok"`, `{"exit_ip": {"v4": "203.0.113.9"}}`} {
		api.setRotate(body)
		if err := p.Rotate(context.Background(), "s1"); err != nil {
			t.Errorf("rotate answered %s: %v, want a rotation", body, err)
		}
		if st := statusOf(t, p, "s1"); st.Rotations != int64(i+1) || st.ExitIP != "" {
			t.Errorf("after a rotation answered %s: %d rotations, exit IP %q; want %d and unknown", body, st.Rotations, st.ExitIP, i+1)
		}
	}
}

// TestListNotFoundSaysWhat: a 404 to the session list is an API base URL
// that names no such API (a path too many, a typo), and the answer's body
// says so. The error said "provider does not know this session", the
// rotate call's meaning, and left the body out.
func TestListNotFoundSaysWhat(t *testing.T) {
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "no route /v2/api/session", http.StatusNotFound)
	}))
	t.Cleanup(api.Close)
	logger, _ := testLogger(t)
	p := newPool(t, upstream.Config{Provider: upstream.ProviderConfig{API: api.URL + "/v2", APIKey: "k"}}, logger)
	err := upstream.RefreshNow(context.Background(), p)
	if err == nil || strings.Contains(err.Error(), "session") && strings.Contains(err.Error(), "does not know") || !strings.Contains(err.Error(), "no route") {
		t.Errorf("list answered 404: %v; want the status and the body, not the rotate call's meaning", err)
	}
}
