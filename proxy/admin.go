package proxy

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"

	"github.com/seed-a3c387e8/onceproxy/proxy/dedup"
)

// Cache is what the admin API needs from the dedup engine.
type Cache interface {
	Stats() dedup.Stats
	InvalidateURL(ctx context.Context, rawURL string) (int, error)
	InvalidateKey(ctx context.Context, key string) error
}

// AdminOptions are what the admin API shows.
type AdminOptions struct {
	// CAPEM is the CA certificate clients must trust, served at /ca.pem.
	CAPEM []byte
	// Health reports extra health details; nil means just "ok".
	Health func() map[string]any
	// Cache serves /cache/stats and /cache/invalidate; nil disables them.
	Cache Cache
	// FleetStats adds the whole fleet's savings to /cache/stats; nil when
	// this instance runs alone.
	FleetStats func(context.Context) (any, error)
	// Metrics serves GET /metrics (Prometheus); nil disables it.
	Metrics http.Handler
	// Token, when set, is required as "Authorization: Bearer <token>" on
	// every endpoint but /health and /ca.pem (which hold nothing secret).
	Token string
	// ProxyAddr is the proxy port's address, shown in the status page's
	// recipes.
	ProxyAddr string
	// Sessions lists the upstream sessions and names the egress, for the
	// status page; nil shows none.
	Sessions func() ([]SessionView, string)
	// Extra registers more routes (the upstream sessions API) on the mux;
	// they get the same token check.
	Extra func(mux *http.ServeMux)
}

// NewAdmin returns the admin API. It is served on its own listener, never
// through the proxy port.
func NewAdmin(o AdminOptions) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", statusPage(o))
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		body := map[string]any{"status": "ok"}
		if o.Health != nil {
			for k, v := range o.Health() {
				body[k] = v
			}
		}
		WriteJSON(w, http.StatusOK, body)
	})
	mux.HandleFunc("GET /ca.pem", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/x-pem-file")
		w.Header().Set("Content-Disposition", `attachment; filename="onceproxy-ca.pem"`)
		_, _ = w.Write(o.CAPEM)
	})
	if o.Metrics != nil {
		mux.Handle("GET /metrics", o.Metrics)
	}
	if o.Extra != nil {
		o.Extra(mux)
	}
	if o.Cache != nil {
		mux.HandleFunc("GET /cache/stats", func(w http.ResponseWriter, r *http.Request) {
			body := map[string]any{"instance": o.Cache.Stats()}
			if o.FleetStats != nil {
				if fs, err := o.FleetStats(r.Context()); err != nil {
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
	if o.Token == "" {
		return mux
	}
	return requireToken(o.Token, mux)
}

// requireToken guards every admin route except the two public ones with a
// bearer token, compared in constant time.
func requireToken(token string, next http.Handler) http.Handler {
	want := sha256.Sum256([]byte(token))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && (r.URL.Path == "/health" || r.URL.Path == "/ca.pem") {
			next.ServeHTTP(w, r)
			return
		}
		scheme, got, _ := strings.Cut(r.Header.Get("Authorization"), " ")
		sum := sha256.Sum256([]byte(strings.TrimSpace(got)))
		if !strings.EqualFold(scheme, "Bearer") || subtle.ConstantTimeCompare(sum[:], want[:]) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="onceproxy admin"`)
			WriteJSON(w, http.StatusUnauthorized, map[string]string{"error": "admin token required (Authorization: Bearer ...)"})
			return
		}
		next.ServeHTTP(w, r)
	})
}

// invalidate handles POST /cache/invalidate with {"url": "..."} (every
// variant of the URL) or {"key": "v1:..."} (one X-Cache-Key).
func invalidate(w http.ResponseWriter, r *http.Request, c Cache) {
	var req struct {
		URL string `json:"url"`
		Key string `json:"key"`
	}
	dec := json.NewDecoder(io.LimitReader(r.Body, 64<<10))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
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
