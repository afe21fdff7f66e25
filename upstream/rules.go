package upstream

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/clientinfo"
	"github.com/seed-a3c387e8/onceproxy/internal/contentcoding"
	"github.com/seed-a3c387e8/onceproxy/internal/hostmatch"
	"github.com/seed-a3c387e8/onceproxy/internal/httpstatus"
	"github.com/seed-a3c387e8/onceproxy/internal/urlcanon"
)

// rule is a compiled upstream.rules entry; the pool's default rule (no
// host, no path, no ban signals) applies when none matches.
type rule struct {
	name         string
	anyHost      bool           // no host pattern: every host
	host         *hostmatch.Set // the rule's host pattern, unless anyHost
	pathPrefix   urlcanon.Prefix
	sticky       string
	banStatuses  []int
	banBody      []byte
	retryMethods []string
	mirror       bool   // fingerprint: mirror (the rule's, else the pool's)
	country      string // exit country of requests that ask for none; "" any
}

func compileRules(cfg Config) (rules []*rule, def *rule) {
	for i, rc := range cfg.Rules {
		name := rc.Name
		if name == "" {
			name = fmt.Sprintf("rules[%d]", i)
		}
		// Config.Validate checked the pattern; were it bad anyway, the
		// nil Set would match no host rather than every host.
		host, _ := hostmatch.Compile([]string{rc.Host})
		r := &rule{
			name:         name,
			anyHost:      rc.Host == "",
			host:         host,
			pathPrefix:   urlcanon.NewPrefix(rc.PathPrefix),
			sticky:       rc.Sticky,
			banStatuses:  slices.Clone(rc.BanStatuses),
			retryMethods: slices.Clone(rc.RetryMethods),
		}
		if rc.BanBody != "" {
			r.banBody = []byte(rc.BanBody)
		}
		if rc.Country != "" {
			r.country, _ = clientinfo.ParseCountry(rc.Country) // validated
		}
		if r.retryMethods == nil {
			r.retryMethods = cfg.Retry.Methods
		}
		r.mirror = cfg.Fingerprint == FingerprintMirror
		if rc.Fingerprint != "" {
			r.mirror = rc.Fingerprint == FingerprintMirror
		}
		rules = append(rules, r)
	}
	return rules, &rule{name: "default", sticky: StickyNone, retryMethods: cfg.Retry.Methods,
		mirror: cfg.Fingerprint == FingerprintMirror}
}

// matches reports whether the rule covers host and path (urlcanon.Path,
// as dedup rules match it; "" for a tunnel, which no path prefix covers).
func (r *rule) matches(host, path string) bool {
	if !r.pathPrefix.IsZero() && (path == "" || !r.pathPrefix.Match(path)) {
		return false
	}
	return r.anyHost || r.host.Match(host)
}

func (r *rule) retries(method string) bool { return slices.Contains(r.retryMethods, method) }

// pickRequest prepares selection for a request of the client described by
// info (account, hint, country, city, logical request key) to host under
// rule r.
func (r *rule) pickRequest(info clientinfo.Info, host string) pickReq {
	account, hint, key := info.Account, info.Session, info.Key
	pr := pickReq{country: info.Country, city: info.City}
	if pr.country == "" {
		pr.country, pr.city = r.country, ""
	}
	// A sticky key is per exit location: one client's session name in two
	// countries is two sessions. Without one the hashes are as they were.
	geo := func(h uint64) uint64 {
		if pr.country == "" && pr.city == "" {
			return h
		}
		return fnvAdd(fnvAdd(h, pr.country), pr.city)
	}
	if hint != "" {
		pr.hint = hint
		pr.hintHash = geo(hashStrings("hint", account, hint))
		pr.sticky = pr.hintHash
	}
	switch r.sticky {
	case StickyHost:
		pr.bucket, pr.bucketH = true, geo(hashStrings("host", strings.ToLower(host)))
	case StickyAccount:
		if account != "" {
			pr.bucket, pr.bucketH = true, geo(hashStrings("account", account))
		}
	case StickyAccountRule:
		if account != "" {
			pr.bucket, pr.bucketH = true, geo(hashStrings("account_rule", account, r.name))
		}
	}
	if pr.sticky == 0 && pr.bucket {
		pr.sticky = pr.bucketH
	}
	if key != "" {
		pr.key = hashStrings("key", key) | 1 // never 0: 0 means "no key"
	}
	return pr
}

// verdict is the classification of one attempt.
type verdict struct {
	kind       outcome
	retryAfter time.Duration
	// neverSent: the request provably did not reach the origin (the
	// gateway refused or the tunnel failed), so any method may be retried.
	neverSent bool
	msg       string
	// gateway: the session's gateway could not be reached at all.
	gateway bool
	// target: the gateway answered that it could not reach the target
	// (TargetUnreachableError). Not charged to the session on sight: see
	// targetMisses in pool.go.
	target bool
	// uncharged: a target miss never charged (TargetUnreachableError).
	uncharged bool
	// site: the verdict is an origin's answer, which speaks of the exit
	// IP at that site (see siteCool): a 429 or a ban benches the session
	// there alone.
	site bool
	// unsure: the connection failed after the gateway set it up (a
	// timeout awaiting the origin's headers, a reset, a handshake with
	// the origin that stalled), which a hanging origin causes through
	// every session alike. Charged to the session only once another one
	// reaches the origin: see targetMisses in pool.go.
	unsure bool
}

// banScanLimit bounds how much of a body is read to look for a ban_body
// substring: bans are short pages, and a rule must not make us buffer a
// 2 GB download.
const banScanLimit = 64 << 10

// classify turns an attempt's result into a verdict. It may replace
// resp.Body (after looking for a ban signal) with a reader that gives the
// client the body intact. When reading the body for the ban signal failed,
// it returns that error too: the response is dead (its body closed), and
// the caller must answer with the error, never with the response.
func (p *Pool) classify(ctx context.Context, r *rule, req *http.Request, resp *http.Response, err error) (verdict, error) {
	if err != nil {
		return classifyErr(ctx, err), nil
	}
	st := resp.StatusCode
	switch {
	case st == http.StatusTooManyRequests:
		// The origin's, for its site, unless the gateway says it wrote it
		// (plain http in absolute form): then it is the session's.
		_, own := gatewayError(resp.Header)
		return verdict{kind: outcomeRateLimited, site: !own, retryAfter: retryAfter(resp.Header.Get("Retry-After"), p.now()), msg: resp.Status}, nil
	case slices.Contains(r.banStatuses, st):
		return verdict{kind: outcomeBanned, site: true, retryAfter: retryAfter(resp.Header.Get("Retry-After"), p.now()), msg: "ban status " + resp.Status}, nil
	case st >= 500:
		return verdict{kind: outcomeServerError, site: true, msg: resp.Status}, nil
	}
	if r.banBody != nil && bodyMayBan(req, resp) {
		found, err := scanBody(resp, r.banBody)
		if err != nil {
			err = fmt.Errorf("read response body: %w", err)
			return classifyErr(ctx, err), err
		}
		if found {
			return verdict{kind: outcomeBanned, site: true, msg: fmt.Sprintf("ban body %q in a %s answer", r.banBody, resp.Status)}, nil
		}
	}
	return verdict{kind: outcomeOK, site: true}, nil
}

// bodyMayBan reports whether resp has a body worth scanning. Never a 101:
// its Body is the live connection of a WebSocket, which goproxy splices and
// a read-ahead would both block on and break.
func bodyMayBan(req *http.Request, resp *http.Response) bool {
	return req.Method != http.MethodHead && httpstatus.BodyAllowed(resp.StatusCode) &&
		resp.Body != nil && resp.Body != http.NoBody
}

func classifyErr(ctx context.Context, err error) verdict {
	var (
		de   *DialError
		tu   *TargetUnreachableError
		gs   *gatewayStatusError
		cert *tls.CertificateVerificationError
		ua   x509.UnknownAuthorityError
		hn   x509.HostnameError
	)
	switch {
	case ctx.Err() != nil || errors.Is(err, context.Canceled):
		// The client or the flight gave up: says nothing about the
		// session, and must never be counted against it.
		return verdict{kind: outcomeNone, msg: err.Error()}
	case errors.As(err, &cert), errors.As(err, &ua), errors.As(err, &hn):
		// The origin's certificate is what it is from every exit IP.
		return verdict{kind: outcomeNone, msg: err.Error()}
	case errors.As(err, &gs) && gs.StatusCode == http.StatusTooManyRequests:
		return verdict{kind: outcomeRateLimited, neverSent: true, retryAfter: gs.RetryAfter, msg: err.Error()}
	case errors.As(err, &tu):
		// Nothing was sent (it failed at CONNECT), and whose fault it is
		// is not known yet: the caller decides (targetMisses).
		return verdict{kind: outcomeNone, neverSent: true, target: true, uncharged: tu.uncharged, msg: err.Error()}
	case errors.As(err, &de):
		return verdict{kind: outcomeConnError, neverSent: true, msg: err.Error(), gateway: gatewayUnreachable(err)}
	default:
		return verdict{kind: outcomeConnError, unsure: true, msg: err.Error()}
	}
}

// retryAfter parses a Retry-After value (seconds or an HTTP date).
func retryAfter(v string, now time.Time) time.Duration {
	if v == "" {
		return 0
	}
	if n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil || errors.Is(err, strconv.ErrRange) {
		// Capped before the multiplication, which would overflow into a
		// negative duration; a number past int64 (ErrRange, n at its
		// bound) is a long wait too, not no value.
		switch {
		case n <= 0:
			return 0
		case n >= int64(maxRetryAfter/time.Second):
			return maxRetryAfter
		}
		return time.Duration(n) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil && t.After(now) {
		return min(t.Sub(now), maxRetryAfter)
	}
	return 0
}

// scanBody reads up to banScanLimit bytes of resp's body, looks for needle
// in them (decoded if the body is compressed), and puts the bytes back in
// front of the rest of the body.
//
// Only io.EOF is the end of a body. io.ReadFull is not used: it reports a
// short body as io.ErrUnexpectedEOF, the very error net/http gives for a
// body cut short (a chunked body without its last chunk, fewer bytes than
// Content-Length), and a truncated body must never pass for a complete
// one. On any other error the body is closed, and the bytes read are put
// back in front of the error, for whoever reads it anyway; the error is
// returned.
func scanBody(resp *http.Response, needle []byte) (bool, error) {
	buf := make([]byte, banScanLimit)
	n := 0
	var err error
	for n < len(buf) && err == nil {
		var nn int
		nn, err = resp.Body.Read(buf[n:])
		n += nn
	}
	buf = buf[:n]
	switch {
	case err == nil:
		resp.Body = &prefixedBody{r: io.MultiReader(bytes.NewReader(buf), resp.Body), c: resp.Body}
	case err == io.EOF: // the clean end of the body, as Read reports it
		resp.Body = &prefixedBody{r: bytes.NewReader(buf), c: resp.Body}
	default:
		resp.Body.Close()
		resp.Body = &prefixedBody{r: io.MultiReader(bytes.NewReader(buf), errReader{err}), c: io.NopCloser(nil)}
		return false, err
	}
	return bytes.Contains(decodePrefix(buf, resp.Header.Get("Content-Encoding")), needle), nil
}

// errReader fails every read with err.
type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) { return 0, r.err }

// decodePrefix decodes as much of a possibly truncated compressed body as
// it can; unknown codings are searched as they are.
func decodePrefix(b []byte, coding string) []byte {
	r, done, err := contentcoding.NewReader(coding, b)
	if err != nil {
		return b
	}
	defer done()
	// A truncated stream ends in an error after the bytes it could decode:
	// keep those. Bound the output: a decompression bomb must not blow up.
	out, _ := io.ReadAll(io.LimitReader(r, 4*banScanLimit))
	return out
}

// prefixedBody is a response body whose first bytes were read ahead.
type prefixedBody struct {
	r io.Reader
	c io.Closer
}

func (b *prefixedBody) Read(p []byte) (int, error) { return b.r.Read(p) }
func (b *prefixedBody) Close() error               { return b.c.Close() }
