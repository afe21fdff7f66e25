package dedup

import (
	"net/http"
	"strconv"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/hostmatch"
	"github.com/seed-a3c387e8/onceproxy/internal/urlcanon"
)

// Rule is a compiled dedup.rules entry (or the default rule): what a
// matching request is keyed on and what of its response may be cached.
// Rules are immutable after compile and shared by all requests.
type Rule struct {
	name       string
	anyHost    bool           // no host pattern: every host
	host       *hostmatch.Set // the rule's host pattern, unless anyHost
	pathPrefix urlcanon.Prefix
	methods    map[string]bool // match filter; nil = any
	optIn      map[string]bool // methods beyond GET/HEAD that are deduplicated
	off        bool
	ttl        time.Duration
	keyer      *Keyer
	statuses   map[int]bool
	setCookie  bool
	private    bool
}

// Name is the rule's name ("default" for the top-level settings).
func (r *Rule) Name() string { return r.name }

// matches reports whether the rule covers a request to host whose path,
// as the key names it, is keyPath (urlcanon.Path: escaped, dot-segments
// removed): the path the cache keeps the answer under, and the one most
// origins answer. Matched against the path as sent, a rule sharing
// responses across credentials for "/public" covered
// "/public/../private/x", keyed as "/private/x"; and a rule turning dedup
// off for "/checkout" missed "/x/../checkout/pay".
func (r *Rule) matches(method, host, keyPath string) bool {
	if r.methods != nil && !r.methods[method] {
		return false
	}
	if !r.pathPrefix.Match(keyPath) {
		return false
	}
	return r.anyHost || r.host.Match(host)
}

// dedups reports whether requests with this method are deduplicated.
func (r *Rule) dedups(method string) bool {
	if r.off {
		return false
	}
	return method == http.MethodGet || method == http.MethodHead || r.optIn[method]
}

// rules is the ordered rule list plus the default rule.
type rules struct {
	list []*Rule
	def  *Rule
}

func compileRules(c Config) *rules {
	def := &Rule{
		name:     "default",
		off:      !c.Enabled,
		ttl:      c.TTL,
		keyer:    NewKeyer(&KeySpec{Headers: c.KeyHeaders, IgnoreParams: c.IgnoreParams, Body: true}),
		statuses: statusSet(c.CacheableStatuses),
	}
	rs := &rules{def: def}
	for i, rc := range c.Rules {
		// Config.Validate checked the pattern; were it bad anyway, the
		// nil Set would match no host rather than every host.
		host, _ := hostmatch.Compile([]string{rc.Host})
		r := &Rule{
			name:       rc.Name,
			anyHost:    rc.Host == "",
			host:       host,
			pathPrefix: urlcanon.NewPrefix(rc.PathPrefix),
			off:        !c.Enabled || rc.Dedup != nil && !*rc.Dedup,
			ttl:        c.TTL,
			statuses:   def.statuses,
			setCookie:  rc.CacheSetCookie,
			private:    rc.CachePrivate,
		}
		if r.name == "" {
			r.name = "rules[" + strconv.Itoa(i) + "]"
		}
		if rc.TTL != nil {
			r.ttl = *rc.TTL
		}
		if rc.CacheableStatuses != nil {
			r.statuses = statusSet(rc.CacheableStatuses)
		}
		if len(rc.Methods) > 0 {
			r.methods = make(map[string]bool, len(rc.Methods))
			r.optIn = make(map[string]bool, len(rc.Methods))
			for _, m := range rc.Methods {
				r.methods[m] = true
				if m != http.MethodGet && m != http.MethodHead {
					r.optIn[m] = true
				}
			}
		}
		headers, ignore := c.KeyHeaders, c.IgnoreParams
		if rc.KeyHeaders != nil {
			headers = rc.KeyHeaders
		}
		if rc.IgnoreParams != nil {
			ignore = rc.IgnoreParams
		}
		// The body is always keyed when a request has one: two POSTs with
		// different bodies are different requests unless BodyFields says
		// which parts matter.
		r.keyer = NewKeyer(&KeySpec{
			Headers:          headers,
			IgnoreParams:     ignore,
			ShareCredentials: rc.ShareCredentials,
			ShareCountries:   rc.ShareCountries,
			Body:             true,
			BodyFields:       rc.BodyFields,
		})
		rs.list = append(rs.list, r)
	}
	return rs
}

// match returns the first rule matching req, or the default rule.
func (rs *rules) match(req *http.Request) *Rule {
	if len(rs.list) == 0 {
		return rs.def
	}
	host, path := req.URL.Hostname(), urlcanon.Path(req.URL)
	for _, r := range rs.list {
		if r.matches(req.Method, host, path) {
			return r
		}
	}
	return rs.def
}

// keyers returns every distinct keyer, for invalidation by URL: an entry's
// URL key was computed by the keyer of the rule that stored it.
func (rs *rules) keyers() []*Keyer {
	out := []*Keyer{rs.def.keyer}
	for _, r := range rs.list {
		out = append(out, r.keyer)
	}
	return out
}

func statusSet(codes []int) map[int]bool {
	m := make(map[int]bool, len(codes))
	for _, c := range codes {
		m[c] = true
	}
	return m
}
