package dedup

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/seed-a3c387e8/onceproxy/internal/contentcoding"
)

// The key never includes Accept-Encoding: the stored body keeps the coding
// the origin sent (those are the bytes the upstream billed), and a client
// that does not accept that coding gets it decoded on the way out.

// acceptsCoding reports whether an Accept-Encoding header value admits
// coding (RFC 9110 §12.5.3). A request without Accept-Encoding accepts only
// identity: in theory it accepts anything, in practice curl and urllib
// cannot decode what they did not ask for.
func acceptsCoding(ae []string, coding string) bool {
	coding = strings.ToLower(coding)
	if coding == "" || coding == "identity" {
		return identityAccepted(ae)
	}
	star := -1.0
	for _, v := range ae {
		for _, part := range strings.Split(v, ",") {
			name, q := parseCoding(part)
			switch {
			case name == coding || coding == "gzip" && name == "x-gzip":
				return q > 0
			case name == "*":
				star = q
			}
		}
	}
	return star > 0
}

func identityAccepted(ae []string) bool {
	star := -1.0
	for _, v := range ae {
		for _, part := range strings.Split(v, ",") {
			name, q := parseCoding(part)
			switch name {
			case "identity":
				return q > 0
			case "*":
				star = q
			}
		}
	}
	return star != 0
}

func parseCoding(part string) (string, float64) {
	name, params, _ := strings.Cut(part, ";")
	name = strings.ToLower(strings.TrimSpace(name))
	q := 1.0
	for _, p := range strings.Split(params, ";") {
		k, v, ok := strings.Cut(strings.TrimSpace(p), "=")
		if ok && strings.EqualFold(strings.TrimSpace(k), "q") {
			if f, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil {
				q = f
			}
		}
	}
	return name, q
}

// contentCodings returns the response's content codings in the order they
// were applied.
func contentCodings(h http.Header) []string {
	var out []string
	for _, v := range h.Values("Content-Encoding") {
		for _, c := range strings.Split(v, ",") {
			if c = strings.ToLower(strings.TrimSpace(c)); c != "" && c != "identity" {
				out = append(out, c)
			}
		}
	}
	return out
}

// errUndecodable means the stored coding is unknown or corrupt, or decodes
// past the limit: the caller must fetch the response for this client instead.
var errUndecodable = errors.New("dedup: cannot decode stored content coding")

// decodeFor returns the body and header to send to a client whose
// Accept-Encoding is ae. When the client accepts the stored coding it gets
// the stored bytes (nil body, nil header: use the entry's). Otherwise the
// body is decoded, up to limit bytes.
func decodeFor(e *Entry, ae []string, limit int64) ([]byte, http.Header, error) {
	codings := contentCodings(e.Header)
	if len(codings) == 0 {
		return nil, nil, nil
	}
	accepted := true
	for _, c := range codings {
		accepted = accepted && acceptsCoding(ae, c)
	}
	if accepted {
		return nil, nil, nil
	}
	body := e.Body
	for i := len(codings) - 1; i >= 0; i-- {
		var err error
		body, err = decode(codings[i], body, limit)
		if err != nil {
			return nil, nil, fmt.Errorf("%w: %s: %v", errUndecodable, codings[i], err)
		}
	}
	h := e.Header.Clone()
	h.Del("Content-Encoding")
	h.Del("Content-Length")
	// A strong validator names the encoded bytes; the decoded body is a
	// different representation (as nginx's gunzip does).
	if etag := h.Get("ETag"); etag != "" && !strings.HasPrefix(etag, "W/") {
		h.Set("ETag", "W/"+etag)
	}
	return body, h, nil
}

func decode(coding string, body []byte, limit int64) ([]byte, error) {
	r, done, err := contentcoding.NewReader(coding, body)
	if err != nil {
		return nil, err
	}
	defer done()
	// Bound the output: a small compressed body can expand without limit.
	out, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(out)) > limit {
		return nil, fmt.Errorf("decoded body exceeds %d bytes", limit)
	}
	return out, nil
}
