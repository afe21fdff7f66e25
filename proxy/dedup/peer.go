package dedup

import (
	"io"
	"net/http"
	"strconv"
	"strings"
)

// PeerPath is where PeerHandler serves bodies: PeerPath + an X-Cache-Key.
const PeerPath = "/dedup/v1/objects/"

// PeerHandler serves the response this instance holds under a key, cached
// or still downloading, to another instance of the fleet: the one upstream
// download of a body too big for the shared store, read by the waiters of
// every instance. GET PeerPath+key answers with the stored status, headers
// and body (bytes as they arrive from the origin; a Range header is
// honoured as for a client) and X-Cache: HIT or COALESCED; 404 when this
// instance holds nothing under key. A download that fails mid-body cuts
// the response (connection or stream reset), as for a client.
//
// The handler trusts its caller: the peer listener authenticates it.
func (e *Engine) PeerHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, ok := strings.CutPrefix(r.URL.Path, PeerPath)
		if r.Method != http.MethodGet || !ok || !validKey(key) {
			http.Error(w, "GET "+PeerPath+"<X-Cache-Key>", http.StatusBadRequest)
			return
		}
		// Peers read the stored bytes, never a copy decoded for them.
		r.Header.Set("Accept-Encoding", "*")
		resp := e.peerResponse(r, key)
		if resp == nil {
			http.Error(w, "no such object here", http.StatusNotFound)
			return
		}
		defer resp.Body.Close()
		for k, vs := range resp.Header {
			w.Header()[k] = vs
		}
		w.WriteHeader(resp.StatusCode)
		if _, err := io.Copy(w, resp.Body); err != nil {
			// Never a short body that looks complete.
			panic(http.ErrAbortHandler)
		}
	})
}

// peerResponse is the response under key, from a flight or the cache; nil
// when there is none.
func (e *Engine) peerResponse(r *http.Request, key string) *http.Response {
	if f := e.flights.attach(key); f != nil {
		select {
		case <-f.ready:
		case <-r.Context().Done():
			e.flights.leave(f, false)
			return nil
		}
		if obj := f.res.obj; obj != nil {
			if r.Header.Get("Range") != "" {
				resp, ok := e.serveRange(r, obj.meta, objectBody{obj, func() { e.flights.leave(f, false) }}, key, CacheCoalesced)
				if ok {
					return resp
				}
				return nil
			}
			if resp, ok := e.serveObject(r, f, obj, key, CacheCoalesced); ok {
				return resp
			}
		}
		e.flights.leave(f, false)
	}
	ent := e.get(r.Context(), key, e.peek) // what this process holds
	if ent == nil {
		return nil
	}
	if r.Header.Get("Range") != "" {
		if resp, ok := e.serveRange(r, ent, wholeEntry(ent), key, CacheHit); ok {
			return resp
		}
		return nil
	}
	resp, ok := e.serve(r, ent, key, CacheHit)
	if !ok {
		return nil
	}
	if resp.ContentLength >= 0 {
		resp.Header.Set("Content-Length", strconv.FormatInt(resp.ContentLength, 10))
	}
	return resp
}

// validKey reports whether key has the form of an X-Cache-Key.
func validKey(key string) bool {
	return strings.HasPrefix(key, keyVersion+":") && len(key) == len(keyVersion)+1+64
}
