package dedup

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/seed-a3c387e8/onceproxy/internal/httpstatus"
)

// Range requests. The key of a request with Range (or If-Range) differs
// from the plain request's, so that a 206 never answers a plain request.
// But a whole object cached or in flight holds every range of it: a Range
// GET is answered from the whole object when there is one (206, or 416,
// or the whole 200 where a server may ignore Range), and otherwise goes
// upstream as it is, keyed with its Range. Fetching the whole object
// instead would bill the whole body for a video player's first megabyte,
// except for a range from the first byte to the last (bytes=0-), which
// costs the whole body either way and so starts the whole object's flight.
//
// One byte range per request is served; a request for several gets the
// whole object (200), which RFC 9110 §14.2 allows and which costs no
// upstream byte.

// fromObject answers a Range GET from the whole object: cached, or being
// downloaded by a flight. handled is false when there is none, or when the
// flight's result is no response to cut (an error): the request then goes
// its usual way.
//
// A request for every byte from the first (bytes=0-: how media players
// and download managers begin) starts the whole object's flight when
// none runs: it costs no byte more than the range, and the object then
// answers every later range of it, and every plain GET, instead of one
// download per way of asking.
func (e *Engine) fromObject(req *http.Request, rule *Rule, body []byte) (resp *http.Response, handled bool, err error) {
	whole := req.Clone(req.Context())
	whole.Header.Del("Range")
	whole.Header.Del("If-Range")
	key, err := rule.keyer.Key(req.Method, req.URL, whole.Header, principalOf(req.Context()), body)
	if err != nil {
		return nil, false, nil
	}
	// The whole store, shared tier included: no flight would look there
	// for the whole object of this Range request.
	ent, found, flightKey := e.find(req.Context(), req, key, e.store.Get)
	if ent != nil {
		resp, ok := e.serveRange(req, ent, wholeEntry(ent), found, CacheHit)
		return resp, ok, nil
	}
	var (
		f               *flight
		leader, settled bool
	)
	if fromFirstByte(req.Header.Get("Range")) {
		f, leader, settled, err = e.ride(whole, rule, flightKey, body)
	} else {
		f, err = e.await(req, flightKey)
	}
	if f == nil {
		return nil, err != nil, err
	}
	res := f.res
	xcache := labelOf(res, leader, settled)
	if ent := res.entry; ent != nil {
		// A whole response (a small body read whole, another instance's
		// copy): every range of it is there.
		e.flights.leave(f, leader)
		if !ent.varyMatches(req.Header) {
			return nil, false, nil
		}
		resp, ok := e.serveRange(req, ent, wholeEntry(ent), flightKey, xcache)
		return resp, ok, nil
	}
	obj := res.obj
	if obj == nil && leader {
		// The whole object's fetch failed, or brought a response not
		// to share: its leader answers with that, as any leader does
		// (the whole body is a right answer to bytes=0-).
		resp, err := e.answer(req, flightKey, f, res, true, xcache)
		return resp, true, err
	}
	if obj == nil || !obj.meta.varyMatches(req.Header) {
		e.flights.leave(f, leader)
		return nil, false, nil
	}
	// serveRange lets go of the body itself when it cannot serve from it.
	// A client that gave up waiting for the body's length goes on to
	// coalesce, which starts nothing for a client already gone.
	resp, ok := e.serveRange(req, obj.meta, objectBody{obj, func() { e.flights.leave(f, leader) }}, flightKey, xcache)
	return resp, ok, nil
}

// fromFirstByte reports whether a Range header asks for one range from
// the first byte to the last.
func fromFirstByte(v string) bool {
	if !singleRange(v) {
		return false
	}
	_, spec, _ := strings.Cut(v, "=")
	first, last, ok := strings.Cut(strings.TrimSpace(spec), "-")
	return ok && strings.TrimSpace(first) == "0" && strings.TrimSpace(last) == ""
}

// wholeBody is a complete or arriving body that can be read from any
// offset.
type wholeBody interface {
	// length is the body's length, waiting for the end of a download
	// whose length was not declared.
	length(ctx context.Context) (int64, error)
	// open reads n bytes from off; n < 0: to the end.
	open(ctx context.Context, off, n int64) (io.ReadCloser, error)
	// done lets go of the body when no reader was opened.
	done()
}

// serveRange answers a Range request from a whole body. ok is false when
// it cannot be served from it at all (the caller goes on without it); b
// is let go of either way once the response's body is closed.
func (e *Engine) serveRange(req *http.Request, meta *Entry, b wholeBody, key, xcache string) (*http.Response, bool) {
	if meta.Status == http.StatusPartialContent {
		// An origin answered the plain request with a part: not the
		// whole object, and not the range this client asked for. It
		// goes upstream with its own Range.
		b.done()
		return nil, false
	}
	rangeHdr := req.Header.Get("Range")
	ae := req.Header.Values("Accept-Encoding")
	// Not a 200, a coding this client needs undone (ranges count encoded
	// bytes), If-Range naming another version, or more than one range:
	// the whole response is the right answer.
	if meta.Status != http.StatusOK || undecodedFor(meta.Header, ae) != nil || !ifRangeMatches(req.Header.Get("If-Range"), meta.Header) || !singleRange(rangeHdr) {
		return e.serveWhole(req, meta, b, key, xcache)
	}
	if ob, ok := b.(objectBody); ok && ob.obj.size < 0 && fromFirstByte(rangeHdr) && !ob.obj.body.complete() {
		// Every byte from the first of a body whose length is not known
		// yet: the whole response is that range, and it can start now,
		// rather than once the download is over (or, past
		// max_object_bytes, relayed and its start gone).
		return e.serveWhole(req, meta, b, key, xcache)
	}
	size, err := b.length(req.Context())
	if err != nil {
		b.done()
		return nil, false
	}
	start, end, ok := parseRange(rangeHdr, size)
	if !ok {
		return e.serveWhole(req, meta, b, key, xcache)
	}
	header := meta.Header.Clone()
	if start < 0 {
		b.done()
		header = http.Header{"Content-Range": {"bytes */" + strconv.FormatInt(size, 10)}, "Content-Length": {"0"}}
		markCache(header, xcache, key)
		e.tally(req, xcache, 0, 0)
		return &http.Response{Status: httpstatus.Line(http.StatusRequestedRangeNotSatisfiable), StatusCode: http.StatusRequestedRangeNotSatisfiable,
			Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1, Header: header, Body: http.NoBody, Request: req}, true
	}
	body, err := b.open(req.Context(), start, end-start)
	if err != nil {
		if fb, ok := b.(fileBody); ok {
			e.fileFailed(key, fb.f, err)
		}
		b.done()
		return nil, false
	}
	n := end - start
	header.Set("Content-Range", "bytes "+strconv.FormatInt(start, 10)+"-"+strconv.FormatInt(end-1, 10)+"/"+strconv.FormatInt(size, 10))
	header.Set("Content-Length", strconv.FormatInt(n, 10))
	markCache(header, xcache, key)
	if xcache == CacheHit {
		header.Set("Age", age(meta))
	}
	e.tallyAnswer(req, meta, xcache, int(n))
	return &http.Response{Status: httpstatus.Line(http.StatusPartialContent), StatusCode: http.StatusPartialContent,
		Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1, Header: header, Body: body, ContentLength: n, Request: req}, true
}

// serveWhole answers with the whole response, ignoring Range.
func (e *Engine) serveWhole(req *http.Request, meta *Entry, b wholeBody, key, xcache string) (*http.Response, bool) {
	ob, streaming := b.(objectBody)
	if !streaming {
		return e.serve(req, meta, key, xcache, false)
	}
	body, err := ob.open(req.Context(), 0, -1)
	if err != nil {
		ob.done()
		return nil, false
	}
	resp, ok := e.streamResponse(req, meta, body, ob.obj.size, key, xcache)
	if !ok {
		body.Close()
	}
	return resp, ok
}

// singleRange reports whether v asks for exactly one range of bytes.
func singleRange(v string) bool {
	unit, spec, ok := strings.Cut(v, "=")
	return ok && strings.EqualFold(strings.TrimSpace(unit), "bytes") && !strings.Contains(spec, ",")
}

// parseRange resolves a single bytes range against size (RFC 9110
// §14.1.2): [start, end) of the bytes to send. start < 0: unsatisfiable
// (416). ok is false for a malformed range, which is ignored.
func parseRange(v string, size int64) (start, end int64, ok bool) {
	_, spec, _ := strings.Cut(v, "=")
	first, last, found := strings.Cut(strings.TrimSpace(spec), "-")
	if !found {
		return 0, 0, false
	}
	first, last = strings.TrimSpace(first), strings.TrimSpace(last)
	if first == "" {
		// A suffix: the last n bytes.
		n, err := strconv.ParseInt(last, 10, 64)
		if err != nil || n < 0 {
			return 0, 0, false
		}
		if n == 0 || size == 0 {
			return -1, 0, true
		}
		return max(size-n, 0), size, true
	}
	a, err := strconv.ParseInt(first, 10, 64)
	if err != nil || a < 0 {
		return 0, 0, false
	}
	b := size - 1
	if last != "" {
		if b, err = strconv.ParseInt(last, 10, 64); err != nil || b < a {
			return 0, 0, false
		}
	}
	if a >= size {
		return -1, 0, true
	}
	return a, min(b, size-1) + 1, true
}

// ifRangeMatches applies If-Range (RFC 9110 §13.1.5): the range is served
// only if the validator names the stored version. An entity tag must
// match strongly; a date must equal Last-Modified.
func ifRangeMatches(v string, h http.Header) bool {
	v = strings.TrimSpace(v)
	if v == "" {
		return true
	}
	if strings.HasPrefix(v, `"`) || strings.HasPrefix(v, "W/") {
		etag := h.Get("ETag")
		return !strings.HasPrefix(v, "W/") && etag != "" && !strings.HasPrefix(etag, "W/") && etag == v
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return false
	}
	lm, err := http.ParseTime(h.Get("Last-Modified"))
	return err == nil && lm.Equal(t)
}

// The whole bodies ranges are cut from.

// wholeEntry is a cached entry's body: in memory or in a disk-tier file.
func wholeEntry(ent *Entry) wholeBody {
	if ent.file != nil {
		return fileBody{ent.file}
	}
	return memBody(ent.Body)
}

type memBody []byte

func (b memBody) length(context.Context) (int64, error) { return int64(len(b)), nil }
func (b memBody) done()                                 {}
func (b memBody) open(_ context.Context, off, n int64) (io.ReadCloser, error) {
	s := b[off:]
	if n >= 0 {
		s = s[:n]
	}
	return io.NopCloser(bytes.NewReader(s)), nil
}

type fileBody struct{ f *diskFile }

func (b fileBody) length(context.Context) (int64, error) { return b.f.size, nil }
func (b fileBody) done()                                 {}
func (b fileBody) open(_ context.Context, off, n int64) (io.ReadCloser, error) {
	f, err := b.f.open()
	if err != nil {
		return nil, err
	}
	if n < 0 {
		n = b.f.size - off
	}
	return struct {
		io.Reader
		io.Closer
	}{io.NewSectionReader(f, off, n), f}, nil
}

// objectBody is a flight's body as it arrives; leave runs when the reader
// opened from it is closed, or from done when none was.
type objectBody struct {
	obj   *object
	leave func()
}

func (b objectBody) length(ctx context.Context) (int64, error) {
	if b.obj.size >= 0 {
		return b.obj.size, nil
	}
	return b.obj.body.length(ctx)
}

func (b objectBody) done() { b.leave() }

func (b objectBody) open(ctx context.Context, off, n int64) (io.ReadCloser, error) {
	r, err := b.obj.body.reader(ctx, off, b.leave)
	if err != nil {
		return nil, err
	}
	if n < 0 {
		return r, nil
	}
	return struct {
		io.Reader
		io.Closer
	}{io.LimitReader(r, n), r}, nil
}
