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
	codings := undecodedFor(e.Header, ae)
	if codings == nil {
		return nil, nil, nil
	}
	if len(e.Body) == 0 {
		// Nothing to decode: a response without a body (fetched by HEAD,
		// a 204, a 304) only loses the coding's fields for this client,
		// its Content-Length among them, which named the coded bytes.
		return nil, decodedHeader(e.Header), nil
	}
	body := e.Body
	for i := len(codings) - 1; i >= 0; i-- {
		var err error
		body, err = decode(codings[i], body, limit)
		if err != nil {
			return nil, nil, fmt.Errorf("%w: %s: %v", errUndecodable, codings[i], err)
		}
	}
	return body, decodedHeader(e.Header), nil
}

// undecodedFor returns the codings of a response with header h that a
// client whose Accept-Encoding is ae does not accept all of: they must be
// undone for it (nil: send the bytes as they are).
func undecodedFor(h http.Header, ae []string) []string {
	codings := contentCodings(h)
	for _, c := range codings {
		if !acceptsCoding(ae, c) {
			return codings
		}
	}
	return nil
}

// decodedHeader is the header of a decoded copy of a response with h.
func decodedHeader(h http.Header) http.Header {
	h = h.Clone()
	h.Del("Content-Encoding")
	h.Del("Content-Length")
	// A strong validator names the encoded bytes; the decoded body is a
	// different representation (as nginx's gunzip does).
	if etag := h.Get("ETag"); etag != "" && !strings.HasPrefix(etag, "W/") {
		h.Set("ETag", "W/"+etag)
	}
	return h
}

// decodeStream returns r decoded from codings (in the order applied),
// reading r as the client reads, up to limit decoded bytes (more is an
// error: a small compressed body can expand without limit). The decoders
// are made on first Read, not here: gzip's reads its header at once, and
// the body may not have arrived yet. errUndecodable: a coding is unknown.
func decodeStream(codings []string, r io.ReadCloser, limit int64) (io.ReadCloser, error) {
	for _, c := range codings {
		if !contentcoding.Known(c) {
			return nil, fmt.Errorf("%w: %s", errUndecodable, c)
		}
	}
	return &decodingBody{src: r, codings: codings, limit: limit}, nil
}

type decodingBody struct {
	src     io.ReadCloser
	codings []string
	limit   int64
	r       io.Reader
	dones   []func()
	n       int64
	err     error
}

func (d *decodingBody) Read(p []byte) (int, error) {
	if d.err != nil {
		return 0, d.err
	}
	if d.r == nil {
		var r io.Reader = d.src
		for i := len(d.codings) - 1; i >= 0; i-- {
			dr, done, err := contentcoding.NewStreamReader(d.codings[i], r)
			if err != nil {
				d.err = fmt.Errorf("%w: %s: %v", errUndecodable, d.codings[i], err)
				return 0, d.err
			}
			d.dones = append(d.dones, done)
			r = dr
		}
		d.r = r
	}
	n, err := d.r.Read(p)
	d.n += int64(n)
	if d.n > d.limit {
		d.err = fmt.Errorf("%w: decoded body exceeds %d bytes", errUndecodable, d.limit)
		return 0, d.err
	}
	if err != nil && err != io.EOF {
		d.err = err
	}
	return n, err
}

func (d *decodingBody) Close() error {
	for _, done := range d.dones {
		done()
	}
	d.dones = nil
	return d.src.Close()
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
