package proxy

import (
	"encoding/json"
	"net/http"
)

// AdminOptions are what the admin API shows.
type AdminOptions struct {
	// CAPEM is the CA certificate clients must trust, served at /ca.pem.
	CAPEM []byte
	// Health reports extra health details; nil means just "ok".
	Health func() map[string]any
}

// NewAdmin returns the admin API. It is served on its own listener, never
// through the proxy port.
func NewAdmin(o AdminOptions) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		body := map[string]any{"status": "ok"}
		if o.Health != nil {
			for k, v := range o.Health() {
				body[k] = v
			}
		}
		writeJSON(w, http.StatusOK, body)
	})
	mux.HandleFunc("GET /ca.pem", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/x-pem-file")
		w.Header().Set("Content-Disposition", `attachment; filename="onceproxy-ca.pem"`)
		_, _ = w.Write(o.CAPEM)
	})
	return mux
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}
