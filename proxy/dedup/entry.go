package dedup

import (
	"bytes"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/seed-a3c387e8/onceproxy/internal/httpstatus"
)

// Entry is one cached upstream response. It is immutable once built:
// many requests read it at the same time, each through its own copy of the
// header map and its own reader over the body.
//
// Stores hold entries whose Body is all in memory (at most max_body_bytes).
// The engine's disk tier returns entries whose body is in a file instead
// (Body nil); those never reach a Store.
type Entry struct {
	Status    int
	Header    http.Header
	Body      []byte
	StoredAt  time.Time
	ExpiresAt time.Time
	// URLKey groups every variant of one URL, for invalidation by URL.
	URLKey string
	// Vary holds the leader request's values of the headers the response's
	// Vary names (Accept-Encoding aside): a request with other values must
	// not be answered from this entry.
	Vary []HeaderValue

	// file holds the body of a disk-tier entry; nil for Body in memory.
	file *diskFile
	// packed is the entry in the form the memory store keeps, when it was
	// built in that form (a flight's small body read straight into it, an
	// entry unpacked from the store); packed.data is nil otherwise. It is
	// only ever set on an entry whose fields are final.
	packed packed
	// private: the entry was unpacked for the one caller that holds it,
	// with a header map of its own (see Engine.serve's sole).
	private bool
	// asked is when the flight that fetched it sent its request: an
	// invalidation since then makes it unfit to keep (invalidationLog).
	// Zero for an entry that did not come from a flight here.
	asked time.Time
}

// askedAt is when e was asked of the origin, as far as this process
// knows: asked, or else when it was stored.
func (e *Entry) askedAt() time.Time {
	if e.asked.IsZero() {
		return e.StoredAt
	}
	return e.asked
}

// HeaderValue is one request header's canonical name and joined value.
type HeaderValue struct {
	Name, Value string
}

// Expiring returns e with ExpiresAt set: e itself when it has one, else a
// copy expiring ttl from now. e may already be shared with readers, so a
// Store never writes to it.
func (e *Entry) Expiring(ttl time.Duration) *Entry {
	if !e.ExpiresAt.IsZero() {
		return e
	}
	c := *e
	c.ExpiresAt = time.Now().Add(ttl)
	return &c
}

// varyMatches reports whether req carries the header values the entry was
// fetched with.
func (e *Entry) varyMatches(h http.Header) bool {
	for _, v := range e.Vary {
		if joinValues(h.Values(v.Name)) != v.Value {
			return false
		}
	}
	return true
}

// shareHeader copies h's map but shares its values, each slice capped at
// its length so that an Add to the copy allocates rather than writes into
// h's. A stored entry's header is never written into (what a response
// changes, it changes with Set or Del on its own map), so a hit costs a
// map instead of a copy of every value. Room is left for the fields every
// answer adds (X-Cache, X-Cache-Key, Age).
func shareHeader(h http.Header) http.Header {
	out := make(http.Header, len(h)+3)
	for k, vs := range h {
		out[k] = vs[:len(vs):len(vs)]
	}
	return out
}

// response builds a fresh *http.Response for one client from the entry.
// A non-nil body and header replace the entry's (a decoded copy).
func (e *Entry) response(req *http.Request, body []byte, header http.Header) *http.Response {
	decoded := body != nil
	if header == nil {
		header = shareHeader(e.Header)
	}
	if !decoded {
		body = e.Body
	} else if httpstatus.BodyAllowed(e.Status) {
		header.Set("Content-Length", strconv.Itoa(len(body)))
	}
	resp := &http.Response{
		Status:     httpstatus.Line(e.Status),
		StatusCode: e.Status,
		Proto:      "HTTP/1.1",
		ProtoMajor: 1,
		ProtoMinor: 1,
		Header:     header,
		Request:    req,
	}
	switch {
	case !httpstatus.BodyAllowed(e.Status):
		resp.Body = http.NoBody
	case req.Method == http.MethodHead:
		// A HEAD answer keeps the Content-Length of what a GET would get
		// (the origin's, for an entry fetched by HEAD).
		resp.Body = http.NoBody
		resp.ContentLength = -1
		if n, err := strconv.ParseInt(header.Get("Content-Length"), 10, 64); err == nil {
			resp.ContentLength = n
		}
	default:
		resp.Body = io.NopCloser(bytes.NewReader(body))
		resp.ContentLength = int64(len(body))
	}
	return resp
}

func joinValues(vs []string) string {
	switch len(vs) {
	case 0:
		return ""
	case 1:
		return trimOWS(vs[0])
	}
	var b []byte
	for i, v := range vs {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, trimOWS(v)...)
	}
	return string(b)
}
