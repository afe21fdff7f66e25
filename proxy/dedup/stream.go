package dedup

import (
	"errors"
	"io"
	"io/fs"
	"net/http"
	"strconv"

	"github.com/seed-a3c387e8/onceproxy/internal/httpstatus"
)

// serveObject answers req from a flight's response while its body
// arrives: the client gets the headers now and reads the body from byte 0
// as the spool fills. Closing the body leaves the flight. ok is false when
// the client cannot be served from it (a coding it does not accept and
// that cannot be decoded, or a body already relayed past its start): the
// caller leaves the flight and fetches for this client.
func (e *Engine) serveObject(req *http.Request, f *flight, obj *object, key, xcache string) (*http.Response, bool) {
	r, err := obj.body.reader(req.Context(), 0, func() { e.flights.leave(f, false) })
	if err != nil {
		return nil, false
	}
	resp, ok := e.streamResponse(req, obj.meta, r, obj.size, key, xcache)
	if !ok {
		// The reader never reached a client: let go of the spool without
		// leaving the flight twice.
		r.onClose = nil
		r.Close()
		return nil, false
	}
	if xcache == CacheHit {
		resp.Header.Set("Age", age(obj.meta))
	}
	return resp, true
}

// serveFile answers req from a disk-tier entry.
func (e *Engine) serveFile(req *http.Request, ent *Entry, key, xcache string) (*http.Response, bool) {
	var body io.ReadCloser = http.NoBody
	if req.Method != http.MethodHead {
		f, err := ent.file.open()
		if err != nil {
			e.fileFailed(key, ent.file, err)
			return nil, false
		}
		body = f
	}
	resp, ok := e.streamResponse(req, ent, body, ent.file.size, key, xcache)
	if !ok {
		body.Close()
		return nil, false
	}
	if xcache == CacheHit {
		resp.Header.Set("Age", age(ent))
	}
	return resp, true
}

// fileFailed is told that the file of key's disk-tier entry could not be
// opened. Evicted since the lookup, removed or cut short under the
// process: then the entry goes too, so that the next request, plain or
// Range, starts a flight instead of finding it again.
func (e *Engine) fileFailed(key string, file *diskFile, err error) {
	if (errors.Is(err, fs.ErrNotExist) || errors.Is(err, errFileCut)) && e.disk != nil {
		e.disk.forget(key, file.path)
	}
}

// streamResponse builds one client's response with meta's status and
// headers and body, which has size bytes (-1: unknown yet), decoded on the
// way when the client does not accept the stored coding.
func (e *Engine) streamResponse(req *http.Request, meta *Entry, body io.ReadCloser, size int64, key, xcache string) (*http.Response, bool) {
	var header http.Header
	if codings := undecodedFor(meta.Header, req.Header.Values("Accept-Encoding")); codings != nil {
		decoded, err := decodeStream(codings, body, int64(e.cfg.MaxObjectBytes)*8)
		if err != nil {
			e.log.Warn("cannot serve stored response to this client", "key", key, "err", err)
			return nil, false
		}
		body, header, size = decoded, decodedHeader(meta.Header), -1
	} else {
		header = meta.Header.Clone()
	}
	if size >= 0 {
		header.Set("Content-Length", strconv.FormatInt(size, 10))
	} else {
		header.Del("Content-Length")
	}
	resp := &http.Response{
		Status:        httpstatus.Line(meta.Status),
		StatusCode:    meta.Status,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        header,
		Body:          body,
		ContentLength: size,
		Request:       req,
	}
	markCache(resp.Header, xcache, key)
	e.tallyAnswer(req, meta, xcache, int(max(size, 0)))
	return resp, true
}
