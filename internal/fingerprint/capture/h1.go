package capture

import (
	"bytes"
	"strconv"
	"strings"

	"github.com/seed-a3c387e8/onceproxy/internal/fingerprint"
)

// Limits of the HTTP/1.x scanner. net/http refuses heads over its
// MaxHeaderBytes (1 MiB by default) and chunk lines over 4 KiB; the scanner
// stops there too rather than buffer more.
const (
	maxHead      = 1<<20 + 4096
	maxChunkLine = 4096
	maxTrailers  = 1 << 16
)

// h1Scanner follows an HTTP/1.x request stream: heads, and bodies by their
// framing, so that it knows where each next head starts. It only holds a
// head (or a chunk line) while it is incomplete. Anything it cannot follow
// exactly as net/http would (an ambiguous framing, a protocol switch, a
// malformed chunk) turns it off for the rest of the connection: it then
// records nothing, which is safe, rather than a head read from a body.
type h1Scanner struct {
	state   h1State
	buf     []byte
	remain  int64 // body bytes to skip (fixed length, or the current chunk)
	trailer int   // trailer bytes seen
	post    bool  // the last request was a POST (see h1SkipCRLF)
	skip    int   // CR and LF bytes h1SkipCRLF may still drop
	off     bool
}

type h1State int

const (
	h1Head      h1State = iota
	h1Fixed             // skipping a Content-Length body
	h1ChunkSize         // reading a chunk-size line
	h1ChunkData         // skipping chunk data
	h1ChunkCRLF         // the CRLF after chunk data
	h1Trailers          // trailer lines after the last chunk
	h1Switched          // CONNECT or Upgrade: what follows may not be HTTP
	// h1SkipCRLF drops up to 4 CR or LF bytes before the head that follows
	// a POST, as net/http's server does for old clients that end a POST
	// body with a stray CRLF.
	h1SkipCRLF
)

// write consumes b and returns the request heads completed in it.
func (s *h1Scanner) write(b []byte) []*fingerprint.H1Request {
	var done []*fingerprint.H1Request
	for len(b) > 0 && !s.off {
		switch s.state {
		case h1SkipCRLF:
			for len(b) > 0 && s.skip > 0 && (b[0] == '\r' || b[0] == '\n') {
				b = b[1:]
				s.skip--
			}
			if len(b) > 0 || s.skip == 0 {
				s.state = h1Head
			}
		case h1Head:
			i := bytes.IndexByte(b, '\n')
			if i < 0 {
				s.buf = append(s.buf, b...)
				b = nil
				break
			}
			s.buf = append(s.buf, b[:i+1]...)
			b = b[i+1:]
			if !headDone(s.buf) {
				break
			}
			r, err := fingerprint.ParseH1Head(s.buf)
			s.buf = s.buf[:0]
			if err != nil {
				s.off = true
				break
			}
			done = append(done, r)
			s.post = r.Method == "POST"
			s.state = h1Head
			s.framing(r)
			if s.state == h1Head {
				s.next()
			}
		case h1Fixed, h1ChunkData:
			k := int64(len(b))
			if k > s.remain {
				k = s.remain
			}
			s.remain -= k
			b = b[k:]
			if s.remain == 0 {
				if s.state == h1Fixed {
					s.next()
				} else {
					s.state = h1ChunkCRLF
				}
			}
		case h1ChunkCRLF:
			k := min(2-len(s.buf), len(b))
			s.buf = append(s.buf, b[:k]...)
			b = b[k:]
			if len(s.buf) < 2 {
				break
			}
			if string(s.buf) != "\r\n" {
				s.off = true
				break
			}
			s.buf = s.buf[:0]
			s.state = h1ChunkSize
		case h1ChunkSize, h1Trailers:
			i := bytes.IndexByte(b, '\n')
			if i < 0 {
				s.buf = append(s.buf, b...)
				b = nil
			} else {
				s.buf = append(s.buf, b[:i+1]...)
				b = b[i+1:]
			}
			if s.state == h1ChunkSize && len(s.buf) > maxChunkLine ||
				s.state == h1Trailers && s.trailer+len(s.buf) > maxTrailers {
				s.off = true
				break
			}
			if i < 0 {
				break
			}
			line := s.buf
			s.buf = s.buf[:0]
			if s.state == h1Trailers {
				s.trailer += len(line)
				if string(line) == "\r\n" {
					s.next()
				}
				break
			}
			size, ok := chunkSize(line)
			if !ok {
				s.off = true
				break
			}
			if size == 0 {
				s.state, s.trailer = h1Trailers, 0
			} else {
				s.state, s.remain = h1ChunkData, size
			}
		case h1Switched:
			s.off = true
		}
		if len(s.buf) > maxHead {
			s.off = true
		}
	}
	if s.off {
		s.buf = nil
	}
	return done
}

// next moves on to the head that follows a complete request.
func (s *h1Scanner) next() {
	s.state = h1Head
	if s.post {
		s.state, s.skip = h1SkipCRLF, 4
	}
}

// headDone reports whether buf, ending in LF, ends with the empty line that
// closes a head.
func headDone(buf []byte) bool {
	return bytes.HasSuffix(buf, []byte("\n\n")) || bytes.HasSuffix(buf, []byte("\n\r\n"))
}

// framing sets the state that follows a request head: the body as
// net/http's server reads a request's (Transfer-Encoding: chunked, else
// Content-Length, else none). Any doubt turns the scanner off.
func (s *h1Scanner) framing(r *fingerprint.H1Request) {
	var te, cl []string
	upgrade := false
	for _, f := range r.Fields {
		// EqualFold, not a switch on ToLower: that allocated a lower-case
		// copy of every field name with a capital in it, on every request.
		switch {
		case strings.EqualFold(f.Name, "Transfer-Encoding"):
			te = append(te, f.Value)
		case strings.EqualFold(f.Name, "Content-Length"):
			cl = append(cl, f.Value)
		case strings.EqualFold(f.Name, "Upgrade"):
			upgrade = true
		}
	}
	switch {
	case r.Method == "CONNECT" || upgrade:
		// A switched protocol's bytes follow, or, if the server refuses,
		// more HTTP; the scanner cannot know which, so it stops.
		s.state = h1Switched
	case len(te) > 0:
		if len(te) != 1 || !strings.EqualFold(te[0], "chunked") || len(cl) > 0 {
			s.off = true
			return
		}
		s.state = h1ChunkSize
	case len(cl) > 0:
		if len(cl) != 1 {
			s.off = true
			return
		}
		n, err := strconv.ParseInt(cl[0], 10, 64)
		if err != nil || n < 0 || cl[0][0] == '+' {
			s.off = true
			return
		}
		if n > 0 {
			s.state, s.remain = h1Fixed, n
		}
	}
}

// chunkSize parses a chunk-size line: hex digits, optional extensions,
// CRLF (RFC 9112 §7.1).
func chunkSize(line []byte) (int64, bool) {
	if !bytes.HasSuffix(line, []byte("\r\n")) {
		return 0, false
	}
	line = line[:len(line)-2]
	if i := bytes.IndexByte(line, ';'); i >= 0 {
		line = line[:i]
	}
	line = bytes.TrimRight(line, " \t")
	if len(line) == 0 || len(line) > 15 {
		return 0, false
	}
	n, err := strconv.ParseInt(string(line), 16, 64)
	if err != nil || n < 0 {
		return 0, false
	}
	return n, true
}
