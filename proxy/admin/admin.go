// Package admin is onceproxy's admin API and status page: health, the CA
// download, cache statistics and invalidation, the upstream sessions and
// their rotation, and Prometheus metrics. It is served on its own listener,
// never through the proxy port, and reads the running parts through the
// small interfaces below.
package admin

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/pprof"
	"slices"
	"strings"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
	"github.com/seed-a3c387e8/onceproxy/internal/httpstatus"
	"github.com/seed-a3c387e8/onceproxy/internal/listenaddr"
	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
	"github.com/seed-a3c387e8/onceproxy/upstream"
)

// Cache is what the admin API needs from the dedup engine.
type Cache interface {
	Stats() dedup.Stats
	InvalidateURL(ctx context.Context, rawURL string) (int, error)
	InvalidateKey(ctx context.Context, key string) error
}

// Fleet is the store the instances of a fleet share.
type Fleet interface {
	// Name names the store ("redis").
	Name() string
	// Available reports whether the shared layer is in use now.
	Available() bool
	// FleetStats reads the whole fleet's per-day savings.
	FleetStats(ctx context.Context) (dedup.FleetStats, error)
}

// Sessions is what the admin API needs from the upstream pool.
type Sessions interface {
	Sessions() []upstream.SessionStatus
	Providers() []upstream.ProviderStatus
	Describe() string
	Rotate(ctx context.Context, id string) error
}

// waiter is the upstream pool's optional report of having no session at
// all yet, for /health.
type waiter interface {
	Waiting() (next time.Duration, waiting bool)
}

// Reloader reads the configuration again and applies what can change
// while the proxy serves.
type Reloader interface {
	Reload() (Reload, error)
}

// Reload is what a configuration reload did.
type Reload struct {
	// Changed are the keys applied.
	Changed []string `json:"changed"`
	// Restart are the changed keys that need a restart: their running
	// values stay until then.
	Restart []string `json:"restart_needed,omitempty"`
}

// Fingerprints lists the fingerprints of recent client connections (the
// proxy server).
type Fingerprints interface {
	ClientFingerprints() []fingerprint.Seen
}

// Inflight counts the requests being served (the proxy server), and says
// when it has begun shutting down.
type Inflight interface {
	Inflight() int64
	ShuttingDown() bool
}

// Options are what the admin API shows. Nil parts turn their endpoints
// off, except the two that always work: /health and /ca.pem.
type Options struct {
	// CAPEM is the CA certificate clients must trust, served at /ca.pem.
	CAPEM []byte
	// Proxy adds the requests in flight to /health.
	Proxy Inflight
	// Cache serves /cache/stats and /cache/invalidate.
	Cache Cache
	// Fleet adds the shared store to /health and the whole fleet's savings
	// to /cache/stats; nil when this instance runs alone.
	Fleet Fleet
	// Sessions serves /upstream/sessions and the rotate endpoint, and the
	// status page's sessions table.
	Sessions Sessions
	// Fingerprints adds the clients' most frequent TLS fingerprints (JA4)
	// to the status page.
	Fingerprints Fingerprints
	// Metrics serves GET /metrics (Prometheus).
	Metrics http.Handler
	// Token, when set, is required as "Authorization: Bearer <token>", or
	// as the password of Basic credentials (a browser's prompt), on every
	// endpoint but /health and /ca.pem (which hold nothing secret).
	Token string
	// ProxyAddr is the proxy port's address, shown in the status page's
	// recipes.
	ProxyAddr string
	// Reloader serves POST /config/reload.
	Reloader Reloader
	// LocalOnly answers requests whose Host is localhost or a loopback
	// address only, when there is no Token: the port listens on
	// loopback, and no other name reaches it but a rebound one.
	LocalOnly bool
	// Pprof serves net/http/pprof under /debug/pprof/ (admin.pprof), so
	// operators can profile their own traffic. Off by default: a profile
	// costs CPU while it runs, and reveals the program's internals.
	Pprof bool
}

// New returns the admin API handler.
func New(o Options) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", statusPage(o))
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		body, status := map[string]any{"status": "ok"}, http.StatusOK
		if o.Proxy != nil {
			body["inflight"] = o.Proxy.Inflight()
			if o.Proxy.ShuttingDown() {
				// The proxy ports take no new client while the requests
				// in flight drain: a balancer must stop sending them.
				body["status"], status = "shutting_down", http.StatusServiceUnavailable
			}
		}
		if o.Fleet != nil {
			body["store"] = o.Fleet.Name()
			body["store_available"] = o.Fleet.Available()
		}
		if w, ok := o.Sessions.(waiter); ok {
			if next, waiting := w.Waiting(); waiting {
				// Still 200: the process is sound, and a restart would
				// only call the provider's API early. A balancer or an
				// operator reads why requests get 503, and for how long.
				body["upstream"] = "no_sessions_yet"
				if next > 0 {
					body["upstream_next_try_in"] = next.String()
				}
			}
		}
		WriteJSON(w, status, body)
	})
	mux.HandleFunc("GET /ca.pem", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/x-pem-file")
		w.Header().Set("Content-Disposition", `attachment; filename="onceproxy-ca.pem"`)
		_, _ = w.Write(o.CAPEM)
	})
	if o.Metrics != nil {
		mux.Handle("GET /metrics", o.Metrics)
	}
	if o.Sessions != nil {
		sessionRoutes(mux, o.Sessions)
	}
	if o.Pprof {
		mux.HandleFunc("GET /debug/pprof/", pprof.Index)
		mux.HandleFunc("GET /debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("GET /debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("GET /debug/pprof/trace", pprof.Trace)
	}
	if o.Reloader != nil {
		mux.HandleFunc("POST /config/reload", func(w http.ResponseWriter, r *http.Request) {
			res, err := o.Reloader.Reload()
			if err != nil {
				body := map[string]any{"error": "configuration refused; the running one stays: " + err.Error()}
				var p interface{ Problems() []string }
				if errors.As(err, &p) {
					body["problems"] = p.Problems()
				}
				WriteJSON(w, http.StatusUnprocessableEntity, body)
				return
			}
			WriteJSON(w, http.StatusOK, res)
		})
	}
	if o.Cache != nil {
		mux.HandleFunc("GET /cache/stats", func(w http.ResponseWriter, r *http.Request) {
			body := map[string]any{"instance": o.Cache.Stats()}
			if o.Fleet != nil {
				if fs, err := o.Fleet.FleetStats(r.Context()); err != nil {
					body["fleet"] = map[string]any{"error": "fleet statistics unavailable: " + err.Error()}
				} else {
					body["fleet"] = fs
				}
			}
			WriteJSON(w, http.StatusOK, body)
		})
		mux.HandleFunc("POST /cache/invalidate", func(w http.ResponseWriter, r *http.Request) {
			invalidate(w, r, o.Cache)
		})
	}
	// A web page the operator's browser opens must not drop the cache or
	// reload the configuration: a form or fetch to 127.0.0.1:9090 is a
	// "simple" request no preflight stops. Cross-origin POSTs (by
	// Sec-Fetch-Site or Origin) are refused; curl sends neither.
	var h http.Handler = http.NewCrossOriginProtection().Handler(mux)
	if o.Token != "" {
		return requireToken(o.Token, h)
	}
	if o.LocalOnly {
		return RequireLocalHost(h)
	}
	return h
}

// RequireLocalHost answers only requests that name this machine in Host
// (localhost, a loopback address) or one of also: a page that points a
// name of its own at 127.0.0.1 (DNS rebinding) is same-origin to the
// browser, and would otherwise read what a token-less loopback port (the
// admin port, the peer listener) serves.
func RequireLocalHost(next http.Handler, also ...string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !listenaddr.Loopback(r.Host) && !slices.ContainsFunc(also, func(h string) bool { return strings.EqualFold(h, r.Host) }) {
			WriteJSON(w, http.StatusMisdirectedRequest, map[string]string{
				"error": "this port answers requests to localhost or a loopback address only (Host: " + r.Host + ")"})
			return
		}
		next.ServeHTTP(w, r)
	})
}

// sessionRoutes serves the upstream sessions API.
func sessionRoutes(mux *http.ServeMux, up Sessions) {
	mux.HandleFunc("GET /upstream/sessions", func(w http.ResponseWriter, r *http.Request) {
		// providers: highest priority first, each with its sessions' ids
		// (the sessions themselves, with their provider, are in sessions).
		type provider struct {
			upstream.ProviderStatus
			SessionIDs []string `json:"session_ids"`
		}
		sessions := up.Sessions()
		var providers []provider
		for _, ps := range up.Providers() {
			pv := provider{ProviderStatus: ps, SessionIDs: []string{}}
			for _, s := range sessions {
				if s.Provider == ps.Name {
					pv.SessionIDs = append(pv.SessionIDs, s.ID)
				}
			}
			providers = append(providers, pv)
		}
		WriteJSON(w, http.StatusOK, map[string]any{
			"egress":    up.Describe(),
			"sessions":  sessions,
			"providers": providers,
		})
	})
	mux.HandleFunc("POST /upstream/sessions/{id}/rotate", func(w http.ResponseWriter, r *http.Request) {
		id := r.PathValue("id")
		if err := up.Rotate(r.Context(), id); err != nil {
			status, ok := httpstatus.Of(err)
			if !ok {
				status = http.StatusBadGateway
			}
			WriteJSON(w, status, map[string]string{"error": err.Error()})
			return
		}
		WriteJSON(w, http.StatusOK, map[string]any{"rotated": id})
	})
}

// requireToken guards every admin route except the two public ones with a
// token, compared in constant time: "Authorization: Bearer <token>" for
// scripts, or Basic credentials with the token as the password (any user
// name) for a browser, which can send no bearer token and would otherwise
// never open the status page. Cross-site POSTs, which a browser would send
// with its remembered Basic credentials, are still refused behind this
// (http.CrossOriginProtection).
func requireToken(token string, next http.Handler) http.Handler {
	want := sha256.Sum256([]byte(token))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// HEAD too: the mux answers it on GET routes, and health checkers
		// use it (HAProxy's httpchk, curl -I).
		public := r.Method == http.MethodGet || r.Method == http.MethodHead
		if public && (r.URL.Path == "/health" || r.URL.Path == "/ca.pem") {
			next.ServeHTTP(w, r)
			return
		}
		got, ok := "", false
		if _, password, basic := r.BasicAuth(); basic {
			got, ok = password, true
		} else if scheme, bearer, _ := strings.Cut(r.Header.Get("Authorization"), " "); strings.EqualFold(scheme, "Bearer") {
			got, ok = bearer, true
		}
		sum := sha256.Sum256([]byte(strings.TrimSpace(got)))
		if !ok || subtle.ConstantTimeCompare(sum[:], want[:]) != 1 {
			w.Header().Add("WWW-Authenticate", `Bearer realm="onceproxy admin"`)
			w.Header().Add("WWW-Authenticate", `Basic realm="onceproxy admin: the admin token as the password", charset="UTF-8"`)
			WriteJSON(w, http.StatusUnauthorized, map[string]string{
				"error": "admin token required (Authorization: Bearer <token>, or Basic with the token as the password)"})
			return
		}
		next.ServeHTTP(w, r)
	})
}

// maxInvalidateBody bounds a POST /cache/invalidate body: one URL or key.
const maxInvalidateBody = 64 << 10

// invalidate handles POST /cache/invalidate with {"url": "..."} (every
// variant of the URL) or {"key": "v1:..."} (one X-Cache-Key).
func invalidate(w http.ResponseWriter, r *http.Request, c Cache) {
	var req struct {
		URL string `json:"url"`
		Key string `json:"key"`
	}
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxInvalidateBody))
	dec.DisallowUnknownFields()
	var tooBig *http.MaxBytesError
	err := dec.Decode(&req)
	if err == nil {
		// One object per request: a second one (NDJSON) would otherwise
		// be dropped without a word while the first is invalidated.
		switch _, extra := dec.Token(); {
		case errors.Is(extra, io.EOF):
		case errors.As(extra, &tooBig):
			err = extra
		default:
			err = errors.New("want one JSON object, found more after it")
		}
	}
	switch {
	case errors.As(err, &tooBig):
		WriteJSON(w, http.StatusRequestEntityTooLarge, map[string]string{"error": "body larger than 64 KiB"})
		return
	case err != nil:
		WriteJSON(w, http.StatusBadRequest, map[string]string{"error": "body must be JSON {\"url\": ...} or {\"key\": ...}: " + err.Error()})
		return
	}
	switch {
	case (req.URL == "") == (req.Key == ""):
		WriteJSON(w, http.StatusBadRequest, map[string]string{"error": "give exactly one of \"url\" or \"key\""})
	case req.URL != "":
		n, err := c.InvalidateURL(r.Context(), req.URL)
		if err != nil {
			WriteJSON(w, statusOf(err), map[string]string{"error": err.Error()})
			return
		}
		WriteJSON(w, http.StatusOK, map[string]any{"url": req.URL, "invalidated": n})
	default:
		if err := c.InvalidateKey(r.Context(), req.Key); err != nil {
			WriteJSON(w, statusOf(err), map[string]string{"error": err.Error()})
			return
		}
		WriteJSON(w, http.StatusOK, map[string]any{"key": req.Key, "invalidated": true})
	}
}

// statusOf: invalid input is the caller's fault; anything else (the store
// is unreachable) is ours.
func statusOf(err error) int {
	if errors.Is(err, dedup.ErrInvalidURL) || errors.Is(err, dedup.ErrInvalidKey) {
		return http.StatusBadRequest
	}
	return http.StatusServiceUnavailable
}

// WriteJSON answers an admin request with v as indented JSON.
func WriteJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}
