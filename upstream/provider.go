package upstream

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/hostmatch"
	"github.com/seed-a3c387e8/onceproxy/internal/netguard"
)

// The provider API, RoProxy-style. Both calls authenticate with
// "Authorization: Bearer API_KEY".
//
// GET {api}/api/session answers 200 with
//
//	{"sessions": [
//	  {"id": "s1", "username": "USER", "password": "PASS",
//	   "gateway_host": "gw.example", "http_port": 8000, "socks5_port": 1080,
//	   "rotation": "sticky", "interval_seconds": 0, "exit_ip": "203.0.113.7",
//	   "weight": 5, "country": "us", "city": "newyork"}
//	]}
//
// id, username, gateway_host and the port of the configured protocol are
// required; rotation is sticky, timed (interval_seconds > 0) or
// per_request (default sticky); exit_ip, weight (1-10, default 5),
// country (ISO 3166-1 alpha-2, either case) and city are optional. Unknown fields are ignored. A list that does not parse, has an
// invalid entry or no session at all is rejected whole: the pool keeps the
// list it had.
//
// POST {api}/api/session/{id}/rotate moves the session to a new exit IP and
// answers 2xx, ideally with the session object above (its exit_ip is then
// known); 404 means the provider does not know the id.

// wireSession is one session as the provider API sends it.
type wireSession struct {
	ID              string  `json:"id"`
	Username        string  `json:"username"`
	Password        string  `json:"password"`
	GatewayHost     string  `json:"gateway_host"`
	HTTPPort        int     `json:"http_port"`
	SOCKS5Port      int     `json:"socks5_port"`
	Rotation        string  `json:"rotation"`
	IntervalSeconds float64 `json:"interval_seconds"`
	ExitIP          string  `json:"exit_ip"`
	Weight          int     `json:"weight"`
	Country         string  `json:"country"`
	City            string  `json:"city"`
}

type wireList struct {
	Sessions []wireSession `json:"sessions"`
}

// maxAPIBody bounds what we read of one API answer.
const maxAPIBody = 4 << 20

// providerClient talks to the provider API. It never goes through an
// upstream session, nor through the process's HTTP_PROXY.
type providerClient struct {
	base     string // API base URL without trailing slash
	key      string
	protocol string // "http" or "socks5": which gateway port sessions use
	apiHost  string // the API's host, for checkGatewayHost
	client   *http.Client
}

// checkGatewayHost refuses a gateway_host on a loopback, private,
// link-local or otherwise non-public address (netguard's classifier, the
// proxy's one rule for what is not public) when the provider's API is on a
// public host. The API's answer decides where the proxy sends its clients'
// requests and the session credentials: an answer that someone else
// controls (a compromised provider, a tampered plain-http API) must not
// turn the proxy onto this host's own services or a cloud metadata
// endpoint. A provider run on an internal network, its API on such an
// address itself, may name gateways there. Names are not resolved here.
func checkGatewayHost(apiHost, gateway string) error {
	var guard *netguard.Guard // the defaults: nothing allowed beyond public addresses
	if guard.CheckHost(apiHost) != nil {
		return nil // the API is on a non-public network itself
	}
	var be *netguard.BlockedError
	if err := guard.CheckHost(gateway); errors.As(err, &be) {
		return fmt.Errorf("gateway_host %q is not a public address (%s) while the provider API's host %q is: refused", gateway, be.Class, apiHost)
	}
	return nil
}

// apiHost is the host of the API URL api (validated by the config).
func apiHost(api string) string {
	u, err := url.Parse(api)
	if err != nil {
		return ""
	}
	return u.Hostname()
}

// newProviderClient calls cfg.API with key (the api_key, or the value of
// api_key_env).
func newProviderClient(cfg ProviderConfig, key string, tlsConf *tls.Config, dialer *net.Dialer) *providerClient {
	return &providerClient{
		base:     strings.TrimRight(cfg.API, "/"),
		key:      key,
		protocol: cfg.Protocol,
		apiHost:  apiHost(cfg.API),
		client: &http.Client{
			Timeout: cfg.Timeout,
			Transport: &http.Transport{
				Proxy:               nil,
				DialContext:         dialer.DialContext,
				TLSClientConfig:     tlsConf,
				TLSHandshakeTimeout: cfg.Timeout,
				// A call every few minutes: no connection worth keeping,
				// and none left behind (with its goroutines) after Close.
				DisableKeepAlives: true,
			},
			CheckRedirect: func(*http.Request, []*http.Request) error {
				// A redirect would carry the bearer token elsewhere.
				return http.ErrUseLastResponse
			},
		},
	}
}

// errProviderNotFound is the provider's 404 for a session id.
var errProviderNotFound = errors.New("provider does not know this session")

// do sends one API call and returns the body of a 2xx answer. notFound,
// when not nil, is what a 404 means for this call (the rotate call's
// errProviderNotFound); else a 404 is any other refusal: to the list call,
// an API base URL that names no such API.
func (c *providerClient) do(ctx context.Context, method, path string, notFound error) ([]byte, error) {
	op := method + " " + c.base + path
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, nil)
	if err != nil {
		return nil, fmt.Errorf("provider API %s: %w", op, err)
	}
	req.Header.Set("Authorization", "Bearer "+c.key)
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", "onceproxy")
	resp, err := c.client.Do(req)
	if err != nil {
		return nil, c.scrub(fmt.Errorf("provider API %s: %w", op, err))
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxAPIBody+1))
	if err != nil {
		return nil, c.scrub(fmt.Errorf("provider API %s: read answer: %w", op, err))
	}
	if len(body) > maxAPIBody {
		return nil, fmt.Errorf("provider API %s: answer larger than %d bytes", op, maxAPIBody)
	}
	switch {
	case resp.StatusCode == http.StatusNotFound && notFound != nil:
		return nil, fmt.Errorf("provider API %s: %s: %w", op, resp.Status, notFound)
	case resp.StatusCode < 200 || resp.StatusCode > 299:
		err := c.scrub(fmt.Errorf("provider API %s: %s: %s", op, resp.Status, snippet(body)))
		if resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusServiceUnavailable {
			if d := retryAfter(resp.Header.Get("Retry-After"), time.Now()); d > 0 {
				return nil, &apiWaitError{err: err, after: d}
			}
		}
		return nil, err
	}
	return body, nil
}

// apiWaitError is a provider API's refusal that says when to call again:
// a 429 or 503 with Retry-After.
type apiWaitError struct {
	err   error
	after time.Duration
}

func (e *apiWaitError) Error() string { return e.err.Error() }
func (e *apiWaitError) Unwrap() error { return e.err }

// apiWait is how long the API asked, in its answer that made err, not to
// be called (0: it did not say).
func apiWait(err error) time.Duration {
	var we *apiWaitError
	if errors.As(err, &we) {
		return we.after
	}
	return 0
}

// apiWaitAttr is apiWait as a log attribute, left out (an empty attribute,
// which slog drops) when the API asked for no wait: "retry_after=0s" read
// as if it had asked to be called again at once.
func apiWaitAttr(err error) slog.Attr {
	if d := apiWait(err); d > 0 {
		return slog.Duration("retry_after", d)
	}
	return slog.Attr{}
}

// list fetches and checks the session list.
func (c *providerClient) list(ctx context.Context) ([]sessionSpec, error) {
	body, err := c.do(ctx, http.MethodGet, "/api/session", nil)
	if err != nil {
		return nil, err
	}
	var wl wireList
	if err := json.Unmarshal(body, &wl); err != nil {
		return nil, c.scrub(fmt.Errorf("provider API GET %s/api/session: answer is not the session list JSON (%v): %s", c.base, err, snippet(body)))
	}
	if len(wl.Sessions) == 0 {
		return nil, c.scrub(fmt.Errorf("provider API GET %s/api/session: no sessions in the answer: %s", c.base, snippet(body)))
	}
	specs := make([]sessionSpec, 0, len(wl.Sessions))
	var errs []error
	seen := map[string]bool{}
	for i, ws := range wl.Sessions {
		spec, err := c.spec(ws)
		if err == nil && seen[spec.id] {
			err = fmt.Errorf("duplicate id %q", spec.id)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("sessions[%d]: %w", i, err))
			continue
		}
		seen[spec.id] = true
		specs = append(specs, spec)
	}
	if len(errs) > 0 {
		return nil, c.scrub(fmt.Errorf("provider API GET %s/api/session: invalid session list: %w", c.base, errors.Join(errs...)))
	}
	return specs, nil
}

// spec turns one wire session into a sessionSpec for the configured protocol.
func (c *providerClient) spec(ws wireSession) (sessionSpec, error) {
	if err := clientinfo.ValidateSessionID(ws.ID); err != nil {
		return sessionSpec{}, fmt.Errorf("id: %w", err)
	}
	if ws.Username == "" {
		return sessionSpec{}, fmt.Errorf("session %s: no username", ws.ID)
	}
	if !validGatewayHost(ws.GatewayHost) {
		return sessionSpec{}, fmt.Errorf("session %s: bad gateway_host %q: want a host name or an IP address", ws.ID, ws.GatewayHost)
	}
	if err := checkGatewayHost(c.apiHost, ws.GatewayHost); err != nil {
		return sessionSpec{}, fmt.Errorf("session %s: %w", ws.ID, err)
	}
	port := ws.HTTPPort
	if c.protocol == "socks5" {
		port = ws.SOCKS5Port
		if err := checkSOCKSCredentials(ws.Username, ws.Password); err != nil {
			return sessionSpec{}, fmt.Errorf("session %s: %w", ws.ID, err)
		}
	}
	if port < 1 || port > 65535 {
		return sessionSpec{}, fmt.Errorf("session %s: no valid %s port", ws.ID, c.protocol)
	}
	rotation := ws.Rotation
	if rotation == "" {
		rotation = RotationSticky
	}
	interval := time.Duration(ws.IntervalSeconds * float64(time.Second))
	if errs := validateRotation("session "+ws.ID, rotation, interval); len(errs) > 0 {
		return sessionSpec{}, errs[0]
	}
	weight := ws.Weight
	if weight == 0 {
		weight = defaultWeight
	}
	if weight < minWeight || weight > maxWeight {
		return sessionSpec{}, fmt.Errorf("session %s: weight must be %d-%d, got %d", ws.ID, minWeight, maxWeight, weight)
	}
	var country, city string
	if ws.Country != "" {
		c, err := clientinfo.ParseCountry(ws.Country)
		if err != nil {
			return sessionSpec{}, fmt.Errorf("session %s: %w", ws.ID, err)
		}
		country = c
	}
	if ws.City != "" {
		c, err := clientinfo.ParseCity(ws.City)
		if err != nil {
			return sessionSpec{}, fmt.Errorf("session %s: %w", ws.ID, err)
		}
		city = c
	}
	return sessionSpec{
		id:      ws.ID,
		apiID:   ws.ID,
		country: country,
		city:    city,
		source:  sourceProvider,
		proxyURL: &url.URL{
			Scheme: c.protocol,
			User:   url.UserPassword(ws.Username, ws.Password),
			Host:   net.JoinHostPort(ws.GatewayHost, strconv.Itoa(port)),
		},
		rotation: rotation,
		interval: interval,
		weight:   weight,
		exitIP:   exitIPOf(ws.ExitIP),
	}, nil
}

// validGatewayHost reports whether h is a host name or an IP address (no
// port, no brackets): the session's URL is built from it and a port, and
// anything else ("gw.example:8000") made a URL whose every dial failed.
func validGatewayHost(h string) bool {
	if _, err := netip.ParseAddr(h); err == nil {
		return !strings.Contains(h, "%") // no IPv6 zone: not a host of the provider's
	}
	return hostmatch.ValidName(h)
}

// exitIPOf is the exit IP a provider reports, "" (unknown) unless it is an
// IP address: what is shown as one, and sent to the fleet in a rotation
// note (where anything else has the whole note rejected), must be one.
func exitIPOf(raw string) string {
	a, err := netip.ParseAddr(strings.TrimSpace(raw))
	if err != nil {
		return ""
	}
	return a.String()
}

// rotate asks the provider for a new exit IP for session id and returns it
// ("" when the answer does not say).
func (c *providerClient) rotate(ctx context.Context, id string) (string, error) {
	body, err := c.do(ctx, http.MethodPost, "/api/session/"+url.PathEscape(id)+"/rotate", errProviderNotFound)
	if err != nil {
		return "", err
	}
	// Only exit_ip is read: the rest of the object may be anything, the
	// rotation is done all the same. No body says the same, without the
	// IP; but a body that is not JSON (an overloaded front page, a
	// captive portal) is no word from the provider that it rotated.
	if len(bytes.TrimSpace(body)) == 0 {
		return "", nil
	}
	if !json.Valid(body) {
		return "", &StatusError{Status: http.StatusBadGateway, Err: c.scrub(fmt.Errorf(
			"provider API POST %s/api/session/%s/rotate: answer is not JSON: %s", c.base, id, snippet(body)))}
	}
	// JSON of another shape (no object, an exit_ip that is no string)
	// is a rotation all the same, its exit IP unknown: decoded into the
	// session object, it was taken for a failed one.
	var ws struct {
		ExitIP json.RawMessage `json:"exit_ip"`
	}
	var ip string
	if json.Unmarshal(body, &ws) != nil || json.Unmarshal(ws.ExitIP, &ip) != nil {
		ip = "" // no object, or its exit_ip no string
	}
	return exitIPOf(ip), nil
}

// scrub makes sure the API key never reaches a log line or an error a
// client or the admin API can see, whatever a library or the provider
// echoes back.
func (c *providerClient) scrub(err error) error {
	if err == nil || c.key == "" || !strings.Contains(err.Error(), c.key) {
		return err
	}
	return errors.New(strings.ReplaceAll(err.Error(), c.key, "<api-key>"))
}

// snippet is the start of an answer body, on one line, for error messages.
// A JSON answer is quoted with the values of its credential-like fields
// redacted: the session list and a session object carry the sessions'
// passwords, and the message reaches logs and the admin API. So is one
// that only looks like JSON (a trailing comma, a body cut short), whose
// fields are found in its text.
func snippet(b []byte) string {
	const n = 120
	if red, ok := redactJSON(b); ok {
		b = red
	} else {
		b = redactFieldsInText(b)
	}
	s := strings.Join(strings.Fields(string(b)), " ")
	if len(s) > n {
		s = s[:n] + "…"
	}
	if s == "" {
		return "(empty body)"
	}
	return strconv.Quote(s)
}

// redactJSON re-encodes a JSON answer with every credential-like field's
// value replaced; ok is false for an answer that is not JSON.
func redactJSON(b []byte) (_ []byte, ok bool) {
	var v any
	if json.Unmarshal(b, &v) != nil {
		return nil, false
	}
	out, err := json.Marshal(redactSecrets(v))
	if err != nil {
		return nil, false
	}
	return out, true
}

// textField is a "name": value pair in text that may not parse as JSON:
// the value a string (its closing quote may be cut off with the body) or
// a bare word.
var textField = regexp.MustCompile(`"((?:[^"\\]|\\.)*)"(\s*:\s*)("(?:[^"\\]|\\.)*(?:"|$)|[^\s,}\]]+)`)

// redactFieldsInText replaces the values of credential-like fields in an
// answer that does not parse as JSON.
func redactFieldsInText(b []byte) []byte {
	var out []byte
	last := 0
	for _, m := range textField.FindAllSubmatchIndex(b, -1) {
		if !secretField(string(b[m[2]:m[3]])) {
			continue
		}
		out = append(out, b[last:m[6]]...)
		out = append(out, `"<redacted>"`...)
		last = m[7]
	}
	return append(out, b[last:]...)
}

func redactSecrets(v any) any {
	switch t := v.(type) {
	case map[string]any:
		for k, x := range t {
			if secretField(k) {
				t[k] = "<redacted>"
			} else {
				t[k] = redactSecrets(x)
			}
		}
	case []any:
		for i, x := range t {
			t[i] = redactSecrets(x)
		}
	}
	return v
}

// secretField reports a field name that may hold a credential: a
// password, a user name (gateways put account and session in it), a key,
// a token or a secret.
func secretField(name string) bool {
	name = strings.ToLower(name)
	for _, w := range []string{"pass", "user", "key", "token", "secret", "auth", "cred"} {
		if strings.Contains(name, w) {
			return true
		}
	}
	return false
}
