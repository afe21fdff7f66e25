package proxy

import (
	"net/http"
	"net/url"
	"strconv"
	"strings"
)

// fetchPath is the API form of the proxy, for clients that cannot set a
// proxy (serverless functions, webhooks, shell scripts, spreadsheets):
// GET /fetch?url=<absolute URL, percent-encoded as a query value> on the
// proxy port goes through the same pipeline as a proxy request for that
// URL (auth, rate limits, the SSRF guard, dedup, sessions and rules) and
// answers with the same headers, X-Cache, X-Cache-Key and
// X-Onceproxy-Upstream included.
const fetchPath = "/fetch"

// fetch serves fetchPath: it turns the call into the absolute-form request
// it stands for and forwards that, so the two paths cannot drift
// apart.
func (s *Server) fetch(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		writeResponse(w, errorResponse(r, http.StatusMethodNotAllowed, kindBadRequest,
			"GET /fetch?url=<absolute URL> fetches one URL; "+r.Method+" is not supported here"))
		return
	}
	target, reason := fetchTarget(r.URL.Query()["url"])
	if reason != "" {
		writeResponse(w, errorResponse(r, http.StatusBadRequest, kindBadRequest, reason))
		return
	}
	out := r.Clone(r.Context())
	out.URL = target
	out.Host = target.Host
	out.RequestURI = ""
	// A client that cannot set a proxy sends its proxy credentials as
	// Authorization: Basic. Used for the proxy, they are not the origin's,
	// and never forwarded.
	if s.users != nil && out.Header.Get("Proxy-Authorization") == "" {
		if a := out.Header.Get("Authorization"); len(a) > 6 && strings.EqualFold(a[:6], "Basic ") {
			out.Header.Set("Proxy-Authorization", a)
			out.Header.Del("Authorization")
		}
	}
	s.forward(w, out)
}

// fetchTarget checks the url parameter of a fetch: exactly one, absolute,
// http or https, with a host. reason says what is wrong, for the 400.
func fetchTarget(vals []string) (*url.URL, string) {
	switch len(vals) {
	case 0:
		return nil, "missing url parameter: GET /fetch?url=<absolute URL, percent-encoded>"
	case 1:
	default:
		return nil, "give exactly one url parameter"
	}
	u, err := url.Parse(vals[0])
	switch {
	case err != nil:
		return nil, "url parameter: " + err.Error()
	case !u.IsAbs():
		return nil, "url parameter " + quote(vals[0]) + " is not an absolute URL (percent-encode it as a query value)"
	case u.Scheme != "http" && u.Scheme != "https":
		return nil, "url parameter: scheme " + quote(u.Scheme) + " is not http or https"
	case u.Host == "" || u.Hostname() == "":
		return nil, "url parameter " + quote(vals[0]) + " has no host"
	case u.User != nil:
		return nil, "url parameter: credentials in the URL are not forwarded; send an Authorization header"
	}
	u.Fragment = ""
	return u, ""
}

// quote quotes a client's value for a reason line, cut to a readable length.
func quote(s string) string {
	if len(s) > 200 {
		s = s[:200] + "…"
	}
	return strconv.Quote(s)
}
