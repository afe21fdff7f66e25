// Package auth is the proxy's user store: who may use the HTTP and SOCKS5
// ports. Passwords are bcrypt hashes in the configuration or plain values
// read from the environment (so they need not sit in a file), compared in
// constant time. The account is what is checked; provider-style session
// hints in the user name ("acme-session-abc") pass through to the pipeline.
package auth

import (
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync/atomic"
	"time"

	"github.com/maypok86/otter/v2"
	"golang.org/x/crypto/bcrypt"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
)

// Config is the `auth:` section of config.yaml.
type Config struct {
	// Users who may use the proxy. None: the ports are open, which is only
	// accepted for loopback listeners unless AllowUnauthenticated is set.
	Users []UserConfig `yaml:"users"`
	// Realm is sent in Proxy-Authenticate challenges. Default "onceproxy".
	Realm string `yaml:"realm"`
	// AllowUnauthenticated accepts running without users on a non-loopback
	// listener (a container whose port is published on the host's loopback,
	// a private network you control). Default false.
	AllowUnauthenticated bool `yaml:"allow_unauthenticated"`
	// MaxFailuresPerMinute is how many new wrong credentials one client
	// (its address) may try in a minute; past it, the credentials it has
	// not had accepted before are refused unchecked until the minute is
	// over (see Users.Verify). 0 = the default, 30; -1 = no limit (New
	// takes anything below 1 as none).
	MaxFailuresPerMinute int `yaml:"max_failures_per_minute"`
}

// UserConfig is one entry of auth.users: exactly one of PasswordBcrypt and
// PasswordEnv.
type UserConfig struct {
	// Name is the account name clients send (session hints may follow it:
	// name-session-ID).
	Name string `yaml:"name"`
	// PasswordBcrypt is a bcrypt hash ("$2a$10$..."; make one with
	// `htpasswd -bnBC 10 "" secret | tr -d ':'`).
	PasswordBcrypt string `yaml:"password_bcrypt"`
	// PasswordEnv names an environment variable holding the password.
	PasswordEnv string `yaml:"password_env"`
}

// WithDefaults returns c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.Realm == "" {
		c.Realm = "onceproxy"
	}
	if c.MaxFailuresPerMinute == 0 {
		c.MaxFailuresPerMinute = 30
	}
	return c
}

// Validate reports every problem in c, each prefixed with its yaml key.
// getenv reads PasswordEnv variables (os.Getenv in production).
func (c Config) Validate(getenv func(string) string) error {
	var errs []error
	if c.MaxFailuresPerMinute < -1 {
		errs = append(errs, fmt.Errorf("max_failures_per_minute: %d: must be -1 (no limit) or more", c.MaxFailuresPerMinute))
	}
	// The realm goes into the challenge as a quoted parameter, verbatim:
	// printable ASCII without the two characters quoting gives a meaning.
	for _, r := range c.Realm {
		if r < ' ' || r > '~' || r == '"' || r == '\\' {
			errs = append(errs, fmt.Errorf("realm: %q: printable ASCII only, without '\"' or '\\'", c.Realm))
			break
		}
	}
	seen := map[string]bool{}
	for i, u := range c.Users {
		key := fmt.Sprintf("users[%d]", i)
		switch {
		case u.Name == "":
			errs = append(errs, fmt.Errorf("%s.name: empty", key))
		case seen[u.Name]:
			errs = append(errs, fmt.Errorf("%s.name: %q listed twice", key, u.Name))
		default:
			if parsed, err := clientinfo.ParseUser(u.Name); err != nil || parsed.Account != u.Name {
				errs = append(errs, fmt.Errorf("%s.name: %q contains a hint (-session-, -sessid-, -country-, -city-); name the account only", key, u.Name))
			}
			for _, r := range u.Name {
				if r == ':' || r <= ' ' || r == 0x7f {
					errs = append(errs, fmt.Errorf("%s.name: %q: no ':', spaces or control characters", key, u.Name))
					break
				}
			}
		}
		seen[u.Name] = true
		switch {
		case (u.PasswordBcrypt == "") == (u.PasswordEnv == ""):
			errs = append(errs, fmt.Errorf("%s: set exactly one of password_bcrypt and password_env", key))
		case u.PasswordBcrypt != "":
			if _, err := bcrypt.Cost([]byte(u.PasswordBcrypt)); err != nil {
				errs = append(errs, fmt.Errorf("%s.password_bcrypt: not a bcrypt hash: %v", key, err))
			}
		case getenv(u.PasswordEnv) == "":
			errs = append(errs, fmt.Errorf("%s.password_env: %s is unset or empty", key, u.PasswordEnv))
		}
	}
	return errors.Join(errs...)
}

// Users is a compiled user store. Its zero value has no users.
type Users struct {
	users map[string]user
	// verified remembers credentials that passed bcrypt recently: bcrypt
	// costs tens of milliseconds on purpose, and every CONNECT carries the
	// password again.
	verified *otter.Cache[[32]byte, struct{}]
	// refused remembers, for a minute, credentials that failed: a fleet
	// of workers deployed with a stale password retries it at the rate it
	// works, and each retry would cost a bcrypt comparison, enough for a
	// few hundred workers to take every core from the traffic. A guesser
	// learns nothing from it: it only answers a guess already refused.
	refused *otter.Cache[[32]byte, struct{}]
	// slow bounds concurrent bcrypt checks to half the CPUs, so that a
	// flood of new wrong passwords leaves the rest to the traffic.
	slow chan struct{}
	// failures counts each client's new wrong credentials in its current
	// minute. The semaphore above keeps a guesser to half the CPUs, but
	// it queues everyone's first login behind the guesses, and every
	// guess is one; past maxFailures a client's untried credentials are
	// not checked at all until its minute is over.
	failures    *otter.Cache[string, *failureWindow]
	maxFailures int32
	// dummy is compared against for unknown users, and after a wrong env
	// password, when bcrypt users exist, so that a refusal takes as long
	// whoever the name belongs to. It has the highest configured cost: the
	// slowest user's refusals must not stand out.
	dummy []byte
}

// failureWindow is one client's count of new wrong credentials from the
// first of them for a minute.
type failureWindow struct {
	until time.Time
	n     atomic.Int32
}

// failureWindowLength is how long a client's failures count against it.
const failureWindowLength = time.Minute

type user struct {
	hash   []byte   // bcrypt
	plain  [32]byte // sha256 of an env password
	isHash bool
}

// New compiles c. getenv reads PasswordEnv variables.
func New(c Config, getenv func(string) string) (*Users, error) {
	if err := c.Validate(getenv); err != nil {
		return nil, fmt.Errorf("auth: %w", err)
	}
	u := &Users{users: make(map[string]user, len(c.Users)), slow: make(chan struct{}, max(1, runtime.GOMAXPROCS(0)/2))}
	dummyCost := 0 // none: no bcrypt users
	for _, uc := range c.Users {
		if uc.PasswordBcrypt != "" {
			u.users[uc.Name] = user{hash: []byte(uc.PasswordBcrypt), isHash: true}
			cost, _ := bcrypt.Cost([]byte(uc.PasswordBcrypt)) // checked by Validate
			dummyCost = max(dummyCost, cost)
		} else {
			u.users[uc.Name] = user{plain: sha256.Sum256([]byte(getenv(uc.PasswordEnv)))}
		}
	}
	if dummyCost > 0 {
		var err error
		if u.dummy, err = bcrypt.GenerateFromPassword([]byte("no such user"), dummyCost); err != nil {
			return nil, fmt.Errorf("auth: hash for unknown users: %w", err)
		}
	}
	u.verified = otter.Must(&otter.Options[[32]byte, struct{}]{
		MaximumSize:      10000,
		ExpiryCalculator: otter.ExpiryWriting[[32]byte, struct{}](10 * time.Minute),
	})
	u.refused = otter.Must(&otter.Options[[32]byte, struct{}]{
		MaximumSize:      10000,
		ExpiryCalculator: otter.ExpiryWriting[[32]byte, struct{}](time.Minute),
	})
	u.maxFailures = int32(min(max(c.MaxFailuresPerMinute, 0), math.MaxInt32))
	u.failures = otter.Must(&otter.Options[string, *failureWindow]{
		MaximumSize:      10000,
		ExpiryCalculator: otter.ExpiryWriting[string, *failureWindow](failureWindowLength),
	})
	return u, nil
}

// Enabled reports whether any user is configured (credentials required).
func (u *Users) Enabled() bool { return u != nil && len(u.users) > 0 }

// Verify reports whether user (with any session hint) and password are
// valid, for a client (clientinfo.ClientOf: its address). It implements
// the proxy's UserStore.
//
// A client that tried MaxFailuresPerMinute new wrong credentials within
// a minute gets, until that minute is over, ok false and how long that
// is, for credentials not accepted before: they are not checked. Ones
// accepted in the last ten minutes still pass, and the same wrong ones
// again (a fleet with a stale password) are refused as before, neither
// counting as a new failure.
func (u *Users) Verify(client, name, password string) (ok bool, retryAfter time.Duration) {
	if !u.Enabled() {
		return false, 0
	}
	// A bad session hint does not change whose credentials these are:
	// the front door refuses the hint itself, to a client it knows.
	parsed, _ := clientinfo.ParseUser(name)
	memo := sha256.Sum256([]byte(parsed.Account + "\x00" + password))
	if _, hit := u.refused.GetIfPresent(memo); hit {
		return false, 0
	}
	if _, hit := u.verified.GetIfPresent(memo); hit {
		return true, 0
	}
	if wait := u.throttled(client); wait > 0 {
		return false, wait
	}
	if !u.check(parsed.Account, password) {
		u.refused.Set(memo, struct{}{})
		u.failed(client)
		return false, 0
	}
	u.verified.Set(memo, struct{}{})
	return true, 0
}

// throttled is how long client's untried credentials are refused
// unchecked: 0 when it is under its failure limit.
func (u *Users) throttled(client string) time.Duration {
	if u.maxFailures == 0 {
		return 0
	}
	w, found := u.failures.GetIfPresent(client)
	if !found || w.n.Load() < u.maxFailures {
		return 0
	}
	// The cache's expiry may lag a little behind the window's end.
	if wait := time.Until(w.until); wait > 0 {
		return max(wait.Round(time.Second), time.Second)
	}
	return 0
}

// failed counts a new wrong credential against client.
func (u *Users) failed(client string) {
	if u.maxFailures == 0 {
		return
	}
	w, _ := u.failures.SetIfAbsent(client, &failureWindow{until: time.Now().Add(failureWindowLength)})
	w.n.Add(1)
}

// check compares password with account's, at the cost of the slowest
// user's for a refusal whoever the account is.
func (u *Users) check(account, password string) bool {
	rec, ok := u.users[account]
	if !ok && u.dummy != nil {
		rec = user{hash: u.dummy, isHash: true}
	}
	if !rec.isHash {
		// Hash both sides so the comparison time does not depend on the
		// password length either. An unknown user compares against a
		// zero digest and fails in the same time.
		got := sha256.Sum256([]byte(password))
		if subtle.ConstantTimeCompare(got[:], rec.plain[:]) == 1 && ok {
			return true
		}
		// With bcrypt users an unknown name pays a bcrypt comparison, so
		// this refusal must too, or its speed would tell that the name is
		// an env user's.
		if u.dummy != nil {
			_ = u.compare(u.dummy, password)
		}
		return false
	}
	return u.compare(rec.hash, password) == nil && ok
}

// compare runs one bcrypt comparison, at most cap(u.slow) at a time.
func (u *Users) compare(hash []byte, password string) error {
	u.slow <- struct{}{}
	defer func() { <-u.slow }()
	return bcrypt.CompareHashAndPassword(hash, []byte(password))
}

// Close stops the cache's background work.
func (u *Users) Close() {
	if u != nil && u.verified != nil {
		u.verified.StopAllGoroutines()
		u.refused.StopAllGoroutines()
		u.failures.StopAllGoroutines()
	}
}
