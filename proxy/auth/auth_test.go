package auth

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"
)

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

// verify is Verify for one client, which is never throttled (no
// MaxFailuresPerMinute in these configurations).
func verify(u *Users, name, password string) bool {
	ok, _ := u.Verify("ip:127.0.0.1", name, password)
	return ok
}

// aliceAndFleet is a store of cfg with alice (bcrypt, password
// alicePassword) and fleet (password_env, "envpass"), closed when t ends.
func aliceAndFleet(t *testing.T, cfg Config, alicePassword string) *Users {
	t.Helper()
	hash, _ := bcrypt.GenerateFromPassword([]byte(alicePassword), bcrypt.MinCost)
	cfg.Users = []UserConfig{
		{Name: "alice", PasswordBcrypt: string(hash)},
		{Name: "fleet", PasswordEnv: "FLEET_PW"},
	}
	u, err := New(cfg, env(map[string]string{"FLEET_PW": "envpass"}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(u.Close)
	return u
}

// observe runs Verify on u, whose semaphore must be unbuffered (then
// each bcrypt comparison shows as a send on it), and says whether it
// made one.
func observe(u *Users, client, name, password string) (ok bool, wait time.Duration, compared bool) {
	type res struct {
		ok   bool
		wait time.Duration
	}
	done := make(chan res, 1)
	go func() { ok, wait := u.Verify(client, name, password); done <- res{ok, wait} }()
	select {
	case <-u.slow:
		u.slow <- struct{}{} // let it release
		r := <-done
		return r.ok, r.wait, true
	case r := <-done:
		return r.ok, r.wait, false
	}
}

func TestVerify(t *testing.T) {
	u := aliceAndFleet(t, Config{}, "s3cret")
	for _, tc := range []struct {
		user, pass string
		want       bool
	}{
		{"alice", "s3cret", true},
		{"alice", "s3cret", true}, // memoized
		{"alice-session-abc", "s3cret", true},
		{"alice", "wrong", false},
		{"alice", "", false},
		{"fleet", "envpass", true},
		{"fleet-cc-DE-sessid-x1", "envpass", false}, // "fleet-cc-DE" is not an account
		{"fleet-sessid-x1-cc-DE", "envpass", true},  // session "x1-cc-DE": the id comes last
		{"fleet-sessid-x1", "envpass", true},
		{"fleet-session-eu-1", "envpass", true},
		// Whose credentials these are does not depend on the hint; the
		// front door refuses the bad hint itself, with the reason.
		{"alice-session-", "s3cret", true},
		{"alice-session-", "wrong", false},
		{"fleet", "envpas", false},
		{"mallory", "s3cret", false},
		{"", "", false},
	} {
		if got := verify(u, tc.user, tc.pass); got != tc.want {
			t.Errorf("Verify(%q, %q) = %v, want %v", tc.user, tc.pass, got, tc.want)
		}
	}
	if !u.Enabled() {
		t.Error("Enabled() = false with users")
	}
	var none *Users
	if none.Enabled() || verify(none, "a", "b") {
		t.Error("nil store lets someone in")
	}
}

func TestValidate(t *testing.T) {
	err := Config{Users: []UserConfig{
		{Name: "", PasswordEnv: "X"},
		{Name: "a", PasswordBcrypt: "h", PasswordEnv: "X"},
		{Name: "a", PasswordBcrypt: "not-bcrypt"},
		{Name: "b-session-x", PasswordEnv: "SET"},
		{Name: "c:d", PasswordEnv: "UNSET"},
		{Name: "e-sessid-", PasswordEnv: "SET"},
		{Name: "f-country-de", PasswordEnv: "SET"},
	}}.Validate(env(map[string]string{"SET": "1", "X": "1"}))
	for _, want := range []string{
		"users[0].name: empty", "users[1]: set exactly one", `users[2].name: "a" listed twice`,
		"users[2].password_bcrypt: not a bcrypt hash", "users[3].name:", "users[4].name:", "users[4].password_env: UNSET is unset",
		`users[5].name: "e-sessid-" contains a hint`,
		`users[6].name: "f-country-de" contains a hint`,
	} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("missing %q in %v", want, err)
		}
	}
}

// TestValidateRealm: the realm goes into a quoted header parameter as
// written; a quote would end it early, a line break would end the header.
func TestValidateRealm(t *testing.T) {
	for realm, ok := range map[string]bool{
		"onceproxy": true, "Acme scrapers (eu-1)": true,
		`say "hi"`: false, `back\slash`: false, "two\nlines": false, "tab\there": false, "caf\u00e9": false,
	} {
		err := Config{Realm: realm}.Validate(env(nil))
		if ok != (err == nil) {
			t.Errorf("realm %q: %v", realm, err)
		}
		if err != nil && !strings.Contains(err.Error(), "realm:") {
			t.Errorf("realm %q: error does not name the key: %v", realm, err)
		}
	}
}

func BenchmarkVerifyMemoized(b *testing.B) {
	hash, _ := bcrypt.GenerateFromPassword([]byte("pw"), 10)
	u, _ := New(Config{Users: []UserConfig{{Name: "a", PasswordBcrypt: string(hash)}}}, env(nil))
	defer u.Close()
	verify(u, "a", "pw")
	b.ReportAllocs()
	for b.Loop() {
		if !verify(u, "a-session-s1", "pw") {
			b.Fatal("rejected")
		}
	}
}

// TestFailuresCostOneBcrypt: whatever the name, a wrong password costs one bcrypt comparison at the highest
// configured cost, so how long a refusal takes does not tell who exists. An env user's wrong password used to be
// refused in microseconds while an unknown name paid a bcrypt comparison, and the stand-in hash for unknown names
// took the cost of the first bcrypt user, not the slowest.
func TestFailuresCostOneBcrypt(t *testing.T) {
	cheap, _ := bcrypt.GenerateFromPassword([]byte("a"), bcrypt.MinCost)
	dear, _ := bcrypt.GenerateFromPassword([]byte("b"), bcrypt.MinCost+2)
	u, err := New(Config{Users: []UserConfig{
		{Name: "cheap", PasswordBcrypt: string(cheap)},
		{Name: "dear", PasswordBcrypt: string(dear)},
		{Name: "fleet", PasswordEnv: "FLEET_PW"},
	}}, env(map[string]string{"FLEET_PW": "envpass"}))
	if err != nil {
		t.Fatal(err)
	}
	defer u.Close()
	if cost, err := bcrypt.Cost(u.dummy); err != nil || cost != bcrypt.MinCost+2 {
		t.Errorf("unknown names compare against cost %d (%v), want the highest configured, %d", cost, err, bcrypt.MinCost+2)
	}
	for _, name := range []string{"fleet", "fleet-session-x", "mallory", "cheap", "dear"} {
		// Unbuffered, the semaphore shows each bcrypt comparison: Verify's acquire is our receive.
		u.slow = make(chan struct{})
		done := make(chan bool, 1)
		// A password of its own each: a refusal repeated is remembered
		// (TestRepeatedFailureCostsOneBcrypt), whoever the name is.
		go func() { done <- verify(u, name, "wrong "+name) }()
		select {
		case <-u.slow:
			u.slow <- struct{}{} // let it release
			if <-done {
				t.Errorf("Verify(%q, wrong) = true", name)
			}
		case ok := <-done:
			t.Errorf("Verify(%q, wrong) = %v without a bcrypt comparison", name, ok)
		}
	}
}

// TestRepeatedFailureCostsOneBcrypt: a client retrying the same wrong
// password (a worker fleet deployed with a stale one) pays one bcrypt
// comparison for it, not one per retry, which let a few hundred such
// workers take every core; the right password still gets in.
func TestRepeatedFailureCostsOneBcrypt(t *testing.T) {
	hash, _ := bcrypt.GenerateFromPassword([]byte("right"), bcrypt.MinCost)
	u, err := New(Config{Users: []UserConfig{{Name: "alice", PasswordBcrypt: string(hash)}}}, env(nil))
	if err != nil {
		t.Fatal(err)
	}
	defer u.Close()
	// Unbuffered, the semaphore shows each bcrypt comparison.
	u.slow = make(chan struct{})
	verify := func(name, password string) (ok, compared bool) {
		ok, _, compared = observe(u, "ip:127.0.0.1", name, password)
		return ok, compared
	}
	for i, name := range []string{"alice", "alice", "alice-session-x", "mallory", "mallory"} {
		ok, compared := verify(name, "stale")
		if ok {
			t.Fatalf("%s/stale accepted", name)
		}
		// alice's first, and mallory's first (another name: its own
		// comparison); "alice-session-x" is alice's account again.
		if want := i == 0 || i == 3; compared != want {
			t.Errorf("attempt %d (%s/stale): bcrypt compared %v, want %v", i+1, name, compared, want)
		}
	}
	if ok, _ := verify("alice", "right"); !ok {
		t.Fatal("the right password was refused after wrong ones")
	}
}

// TestFailureLimit: past max_failures_per_minute new wrong credentials,
// a client's untried credentials are refused unchecked (no bcrypt
// comparison) with how long until its minute is over, the right password
// included; credentials it had accepted before still pass, a stale
// password retried is not a new failure, and other clients are not
// affected.
func TestFailureLimit(t *testing.T) {
	u := aliceAndFleet(t, Config{MaxFailuresPerMinute: 3}, "right")
	const guesser, other = "ip:127.0.0.2", "ip:127.0.0.3"
	// Unbuffered, the semaphore shows each bcrypt comparison.
	u.slow = make(chan struct{})
	if ok, _, _ := observe(u, guesser, "alice", "right"); !ok {
		t.Fatal("right password refused")
	}
	for i := range 3 {
		if ok, wait, compared := observe(u, guesser, "alice", fmt.Sprint("guess", i)); ok || wait != 0 || !compared {
			t.Fatalf("guess %d: ok %v, wait %v, compared %v; want a refusal after a comparison", i, ok, wait, compared)
		}
	}
	// The same stale password again: remembered, not a new failure.
	if ok, wait, compared := observe(u, guesser, "alice", "guess0"); ok || wait != 0 || compared {
		t.Fatalf("repeated guess: ok %v, wait %v, compared %v", ok, wait, compared)
	}
	ok, wait, compared := observe(u, guesser, "alice", "guess3")
	if ok || compared || wait <= 0 || wait > failureWindowLength {
		t.Fatalf("guess past the limit: ok %v, wait %v, compared %v; want an unchecked refusal with a wait of at most a minute", ok, wait, compared)
	}
	// An env user's password, right but never accepted from here: not
	// checked either.
	if ok, wait, _ := observe(u, guesser, "fleet", "envpass"); ok || wait <= 0 {
		t.Fatalf("untried right env password while over the limit: ok %v, wait %v", ok, wait)
	}
	// Accepted before: still passes, with any session hint.
	if ok, wait, _ := observe(u, guesser, "alice-session-s1", "right"); !ok || wait != 0 {
		t.Fatalf("accepted credentials over the limit: ok %v, wait %v", ok, wait)
	}
	// Another client is not affected.
	if ok, wait, compared := observe(u, other, "alice", "guess4"); ok || wait != 0 || !compared {
		t.Fatalf("another client: ok %v, wait %v, compared %v", ok, wait, compared)
	}
	if ok, _, _ := observe(u, other, "fleet", "envpass"); !ok {
		t.Fatal("another client's right env password refused")
	}
	// The minute over, the guesser's credentials are checked again.
	w, _ := u.failures.GetIfPresent(guesser)
	w.until = time.Now().Add(-time.Second)
	if ok, wait, _ := observe(u, guesser, "fleet", "envpass"); !ok || wait != 0 {
		t.Fatalf("after the window: ok %v, wait %v", ok, wait)
	}
}

func TestValidateFailureLimit(t *testing.T) {
	if err := (Config{MaxFailuresPerMinute: -1}).Validate(env(nil)); err != nil {
		t.Fatalf("-1 (no limit): %v", err)
	}
	if err := (Config{MaxFailuresPerMinute: -2}).Validate(env(nil)); err == nil || !strings.Contains(err.Error(), "max_failures_per_minute: -2") {
		t.Fatalf("negative limit: %v", err)
	}
}
