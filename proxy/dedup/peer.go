package dedup

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/seed-a3c387e8/onceproxy/internal/bufpool"
	"github.com/seed-a3c387e8/onceproxy/internal/httpstatus"
)

// A body too big for the shared store crosses the fleet once: the
// instance that leads its flight downloads it and serves it, as it
// arrives, from PeerHandler; the other instances' flights read it from
// there (Options.Peers) into their own spools, for their own readers, and
// cache it themselves. A follower whose peer fails finishes the body from
// the origin (see peerBody).

// PeerPath is where PeerHandler serves bodies: PeerPath + an X-Cache-Key.
const PeerPath = "/dedup/v1/objects/"

// headerPeerVary carries, from PeerHandler to the follower, the leader
// request's values of the headers the response varies on: the follower's
// own requests may have others, and must then not be answered with it.
const headerPeerVary = "X-Onceproxy-Peer-Vary"

// peerReadKey marks a request PeerHandler serves: it is not a client's and
// is not counted in this instance's statistics.
type peerReadKey struct{}

func isPeerRead(ctx context.Context) bool { return ctx.Value(peerReadKey{}) != nil }

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
		r = r.WithContext(context.WithValue(r.Context(), peerReadKey{}, true))
		// Peers read the stored bytes, never a copy decoded for them.
		r.Header.Set("Accept-Encoding", "*")
		resp, vary := e.peerResponse(r, key)
		if resp == nil {
			http.Error(w, "no such object here", http.StatusNotFound)
			return
		}
		defer resp.Body.Close()
		httpstatus.CopyHeader(w.Header(), resp.Header)
		if len(vary) > 0 {
			v := url.Values{}
			for _, hv := range vary {
				v.Add(hv.Name, hv.Value)
			}
			w.Header().Set(headerPeerVary, v.Encode())
		}
		w.WriteHeader(resp.StatusCode)
		if err := copyFlushing(w, resp.Body); err != nil {
			// Never a short body that looks complete.
			panic(http.ErrAbortHandler)
		}
	})
}

// copyFlushing copies body to w, flushing each chunk: the peer reads the
// bytes as they arrive here, not once a buffer fills.
func copyFlushing(w http.ResponseWriter, body io.Reader) error {
	rc := http.NewResponseController(w)
	bp := bufpool.Get()
	defer bufpool.Put(bp)
	buf := *bp
	for {
		n, err := body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return werr
			}
			if ferr := rc.Flush(); ferr != nil {
				return ferr
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// peerResponse is the response under key, from a flight or the cache, and
// the vary values it was fetched with; nil when there is none.
func (e *Engine) peerResponse(r *http.Request, key string) (*http.Response, []HeaderValue) {
	if f := e.flights.attach(key); f != nil {
		select {
		case <-f.ready:
		case <-r.Context().Done():
			e.flights.leave(f, false)
			return nil, nil
		}
		if obj := f.res.obj; obj != nil {
			if r.Header.Get("Range") != "" {
				resp, ok := e.serveRange(r, obj.meta, objectBody{obj, func() { e.flights.leave(f, false) }}, key, CacheCoalesced)
				if ok {
					return resp, obj.meta.Vary
				}
				return nil, nil
			}
			if resp, ok := e.serveObject(r, f, obj, key, CacheCoalesced); ok {
				return resp, obj.meta.Vary
			}
		}
		e.flights.leave(f, false)
	}
	ent := e.get(r.Context(), key, e.peek) // what this process holds
	if ent == nil {
		return nil, nil
	}
	if r.Header.Get("Range") != "" {
		if resp, ok := e.serveRange(r, ent, wholeEntry(ent), key, CacheHit); ok {
			return resp, ent.Vary
		}
		return nil, nil
	}
	resp, ok := e.serve(r, ent, key, CacheHit, true)
	if !ok {
		return nil, nil
	}
	if resp.ContentLength >= 0 {
		resp.Header.Set("Content-Length", strconv.FormatInt(resp.ContentLength, 10))
	}
	return resp, ent.Vary
}

// validKey reports whether key has the form of an X-Cache-Key: the version
// and 64 lower-case hex digits (hexKey). Anything else in the path (dot
// segments, other bytes) is a malformed request, never looked up.
func validKey(key string) bool {
	sum, ok := strings.CutPrefix(key, keyVersion+":")
	if !ok || len(sum) != 64 {
		return false
	}
	for i := 0; i < len(sum); i++ {
		if c := sum[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// askPeer asks peer for the body under key, for this instance's flight:
// its response when it serves the object, nil when it cannot (refused,
// timed out, a bad token, nothing under key), which the caller answers
// with its own download.
//
// ranged says the flight's own request carries a Range (key is that
// range's): the peer's answer is then the flight's answer to it, a 206
// included.
func (e *Engine) askPeer(ctx context.Context, key string, peer Peer, ranged bool) *http.Response {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+peer.Addr+PeerPath+key, nil)
	if err == nil {
		var resp *http.Response
		if resp, err = e.peers.RoundTrip(req); err == nil {
			if err = wholePeerAnswer(resp, key, ranged); err == nil {
				return resp
			}
			if !resp.Close && resp.StatusCode != http.StatusSwitchingProtocols {
				// A refusal's few bytes, so that the connection goes
				// back to the pool; one that cannot (a 101 holds the
				// raw connection) is not read at all: it may be silent.
				_, _ = io.CopyN(io.Discard, resp.Body, 4<<10)
			}
			resp.Body.Close()
		}
	}
	e.st.peerFallback.Add(1)
	e.log.Warn("could not read a body from the instance downloading it; fetching it from the origin",
		"key", key, "peer", peer.Instance, "addr", peer.Addr, "err", err)
	return nil
}

// wholePeerAnswer reports why resp, a peer's answer to a GET of key
// without Range, is not that whole body, which the follower can read into
// its flight; nil when it is. The follower's clients would get what it
// takes as it is, and its cache keep it.
func wholePeerAnswer(resp *http.Response, key string, ranged bool) error {
	switch {
	case resp.Header.Get(HeaderCacheKey) != key:
		// Not one of its objects: the listener's refusal (a bad
		// token), or nothing held under key any more.
		return fmt.Errorf("%w: %s", errPeer, resp.Status)
	case resp.StatusCode < http.StatusOK || resp.StatusCode == http.StatusPartialContent && !ranged:
		// Neither a part nor an upgrade answers a GET of the whole body.
		return fmt.Errorf("%w: %s to a GET of the whole body", errPeer, resp.Status)
	case resp.ProtoMajor == 1 && resp.ContentLength < 0 && !slices.Contains(resp.TransferEncoding, "chunked"):
		// A body that ends where the connection does: a peer killed in
		// the middle of it would look like its end, a short body
		// cached as the whole. PeerHandler sends a length or chunks.
		return fmt.Errorf("%w: %s with a body delimited by the connection's close, whose cut looks like its end", errPeer, resp.Status)
	}
	return nil
}

// peerHeaders removes from a peer's response what the peer added for this
// instance (its X-Cache, its vary values) and returns the vary values.
func peerHeaders(h http.Header) []HeaderValue {
	raw := h.Get(headerPeerVary)
	for _, k := range []string{HeaderCache, HeaderCacheKey, "Age", headerPeerVary} {
		h.Del(k)
	}
	if raw == "" {
		return nil
	}
	v, err := url.ParseQuery(raw)
	if err != nil {
		// Unreadable: no local request may take it for its variant.
		return []HeaderValue{{Name: headerPeerVary, Value: raw}}
	}
	var out []HeaderValue
	for name, vals := range v {
		for _, val := range vals {
			out = append(out, HeaderValue{Name: http.CanonicalHeaderKey(name), Value: val})
		}
	}
	return out
}

// peerBody is a flight's body read from a peer. When the peer fails in the
// middle of it (killed, cut off, its own download failed) the follower
// finishes it from the origin: it asks for the same representation (the
// stored coding; from the byte it had, with If-Range, when the response
// has a strong ETag), and otherwise reads the origin's body from byte 0,
// checks it against the bytes the readers already have, and goes on from
// there. Only what cannot be proven the same body is an error for the
// readers: a response of another status, length, coding or validator, or
// other bytes. Readers never get a body spliced from two versions, nor a
// short one.
type peerBody struct {
	e      *Engine
	key    string
	peer   Peer
	ctx    context.Context // the flight's
	origin *http.Request   // the flight's request, to finish from the origin; nil: it cannot be
	meta   *Entry          // what the readers were told
	size   int64           // declared length; -1 unknown
	sp     *spool          // the bytes already read, to check the origin's against

	cur     io.ReadCloser // the peer's body, then the origin's
	off     int64         // bytes returned so far
	pending error         // the peer's failure, handled at the next Read
	resumed bool          // cur is the origin's
	verify  int64         // bytes of the origin's body still to compare with the spool
	check   *spoolReader  // reads the spool for that comparison
	scratch []byte
	counted bool // as one of peer_fetches ok, fallback, failed
}

func (e *Engine) newPeerBody(key string, peer Peer, body io.ReadCloser, req *http.Request, meta *Entry, size int64, sp *spool) *peerBody {
	b := &peerBody{e: e, key: key, peer: peer, ctx: req.Context(), meta: meta, size: size, sp: sp, cur: body}
	// Finishing from the origin means asking for the same bytes again:
	// only a GET without a range can be.
	if req.Method == http.MethodGet && req.Header.Get("Range") == "" {
		b.origin = req
	}
	return b
}

// Read reads the body. While it compares the origin's bytes with the
// spool's it returns 0, nil after each chunk: the download's stall timer
// measures the origin's silence, and the origin is not silent then.
func (b *peerBody) Read(p []byte) (int, error) {
	if b.pending != nil {
		err := b.pending
		b.pending = nil
		if err = b.resume(err); err != nil {
			return 0, err
		}
	}
	if b.verify > 0 {
		return 0, b.compare(p)
	}
	n, err := b.cur.Read(p)
	b.off += int64(n)
	if b.size >= 0 && b.off > b.size {
		return 0, b.fail(fmt.Errorf("%s sent more than the %d bytes its response declared", b.source(), b.size))
	}
	switch {
	case err == nil:
		return n, nil
	case err == io.EOF && (b.size < 0 || b.off == b.size):
		b.count(true)
		return n, io.EOF
	case err == io.EOF:
		err = io.ErrUnexpectedEOF
	}
	if !b.resumed && b.origin != nil && b.ctx.Err() == nil {
		if n > 0 {
			// These bytes reach the spool first: the origin's are
			// compared with every byte the readers may have.
			b.pending = err
			return n, nil
		}
		if err := b.resume(err); err != nil {
			return 0, err
		}
		return 0, nil
	}
	return n, b.fail(fmt.Errorf("%s: %w", b.source(), err))
}

func (b *peerBody) source() string {
	if b.resumed {
		return "origin"
	}
	return "peer " + b.peer.Addr
}

// resume replaces the failed peer body with the origin's, from b.off.
func (b *peerBody) resume(cause error) error {
	b.resumed = true
	b.cur.Close()
	b.e.st.peerFallback.Add(1)
	b.counted = true
	b.e.log.Warn("the instance serving a body failed mid-body; finishing it from the origin",
		"key", b.key, "peer", b.peer.Instance, "addr", b.peer.Addr, "at", b.off, "err", cause)
	body, verify, err := b.e.fromOrigin(b.origin, b.meta, b.size, b.off)
	if err != nil {
		return fmt.Errorf("peer %s failed mid-body (%v), and the origin cannot finish it: %w", b.peer.Addr, cause, err)
	}
	b.cur = body
	if verify > 0 {
		b.verify = verify
		if b.check, err = b.sp.reader(b.ctx, 0, nil); err != nil {
			return fmt.Errorf("peer %s failed mid-body (%v), and the bytes to check the origin's against are gone: %w", b.peer.Addr, cause, err)
		}
	}
	return nil
}

// compare reads the next chunk of the origin's body that the readers have
// already had from the peer and checks it against the spool.
func (b *peerBody) compare(p []byte) error {
	k := min(int64(len(p)), b.verify, 32<<10)
	theirs := p[:k]
	if _, err := io.ReadFull(b.cur, theirs); err != nil {
		return b.fail(fmt.Errorf("origin, finishing a body the peer cut: %w", err))
	}
	if b.scratch == nil {
		b.scratch = make([]byte, 32<<10)
	}
	ours := b.scratch[:k]
	if _, err := io.ReadFull(b.check, ours); err != nil {
		return b.fail(fmt.Errorf("spool, checking the origin's bytes: %w", err))
	}
	if !bytes.Equal(ours, theirs) {
		return b.fail(errors.New("the origin sent other bytes than the peer had: the body changed; not spliced"))
	}
	if b.verify -= k; b.verify == 0 {
		b.check.Close()
		b.check = nil
	}
	return nil
}

// fail is the end of a body neither the peer nor the origin finished.
func (b *peerBody) fail(err error) error {
	b.count(false)
	return err
}

func (b *peerBody) count(ok bool) {
	if b.counted {
		return
	}
	b.counted = true
	if ok {
		b.e.st.peerOK.Add(1)
	} else {
		b.e.st.peerFailed.Add(1)
	}
}

func (b *peerBody) Close() error {
	if b.check != nil {
		b.check.Close()
	}
	b.count(false) // a body left unfinished, if it was
	return b.cur.Close()
}

// fromOrigin asks the origin for the rest of a body whose first off bytes
// the readers have, as described by meta (status, coding, validators) and
// size. It returns the origin's body positioned at off, or at 0 with
// verify = off: those bytes are to be compared before the rest is read.
func (e *Engine) fromOrigin(orig *http.Request, meta *Entry, size, off int64) (body io.ReadCloser, verify int64, err error) {
	req := orig.Clone(orig.Context())
	req.Header.Del("If-Range")
	// The same representation: the coding the readers were told.
	if codings := contentCodings(meta.Header); len(codings) > 0 {
		req.Header.Set("Accept-Encoding", strings.Join(codings, ", "))
	} else {
		req.Header.Set("Accept-Encoding", "identity")
	}
	etag := meta.Header.Get("ETag")
	ranged := off > 0 && size > 0 && meta.Status == http.StatusOK && etag != "" && !strings.HasPrefix(etag, "W/")
	if ranged {
		req.Header.Set("Range", "bytes="+strconv.FormatInt(off, 10)+"-")
		req.Header.Set("If-Range", etag)
	}
	e.st.upstream.Add(1)
	resp, err := e.next.RoundTrip(req)
	if err != nil {
		return nil, 0, err
	}
	bad := func(why string) (io.ReadCloser, int64, error) {
		resp.Body.Close()
		return nil, 0, fmt.Errorf("%s (%s)", why, resp.Status)
	}
	if !sameRepresentation(meta.Header, resp.Header) {
		return bad("the origin answers with another representation (coding, type or validators differ)")
	}
	if ranged && resp.StatusCode == http.StatusPartialContent {
		want := "bytes " + strconv.FormatInt(off, 10) + "-" + strconv.FormatInt(size-1, 10) + "/" + strconv.FormatInt(size, 10)
		if resp.Header.Get("Content-Range") != want {
			return bad("the origin's range is not the rest of the body: " + resp.Header.Get("Content-Range"))
		}
		return resp.Body, 0, nil
	}
	if resp.StatusCode != meta.Status {
		return bad("the origin answers with another status")
	}
	if size >= 0 && resp.ContentLength >= 0 && resp.ContentLength != size {
		return bad("the origin's body has another length")
	}
	return resp.Body, off, nil
}

// sameRepresentation reports whether a response's headers describe the
// same bytes as the stored ones: coding, type and the validators the
// stored response had.
func sameRepresentation(stored, got http.Header) bool {
	if !slices.Equal(contentCodings(stored), contentCodings(got)) || stored.Get("Content-Type") != got.Get("Content-Type") {
		return false
	}
	for _, v := range []string{"ETag", "Last-Modified"} {
		if s := stored.Get(v); s != "" && s != got.Get(v) {
			return false
		}
	}
	return true
}
