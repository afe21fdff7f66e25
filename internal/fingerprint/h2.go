package fingerprint

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"golang.org/x/net/http2/hpack"
)

// ClientPreface is what every HTTP/2 client sends first (RFC 9113 §3.4).
const ClientPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

// A Setting is one SETTINGS parameter as sent.
type Setting struct {
	ID  uint16
	Val uint32
}

// A Priority is RFC 7540 priority information, from a PRIORITY frame or a
// HEADERS frame's priority block. Weight is the wire value, one less than
// the weight (0 means 1, 255 means 256), as in x/net's PriorityParam.
type Priority struct {
	StreamID  uint32 // the stream it is about (0 in a HEADERS block)
	Exclusive bool
	StreamDep uint32
	Weight    uint8
}

// H2 is a client's HTTP/2 connection preface: what it sent before and with
// its first request. Fingerprinters read exactly this.
type H2 struct {
	// Settings of the client's first SETTINGS frame, in wire order.
	Settings []Setting
	// WindowUpdate is the increment of the first connection-level
	// WINDOW_UPDATE sent before the first request; 0 if none.
	WindowUpdate uint32
	// Priorities are the PRIORITY frames sent before the first request.
	Priorities []Priority
	// PseudoOrder is the first request's pseudo-header order
	// (":method", ":authority", ...).
	PseudoOrder []string
	// HeaderPriority is the first request's HEADERS priority block, nil
	// when the frame had none.
	HeaderPriority *Priority
	// FirstStreamID is the first request's stream (1 for most clients;
	// clients that build a priority tree from idle streams start higher).
	FirstStreamID uint32
}

// Akamai returns the Akamai HTTP/2 fingerprint (Black Hat EU 2017):
// "SETTINGS|WINDOW_UPDATE|PRIORITY|PSEUDO", e.g. Chrome's
// "1:65536;2:0;4:6291456;6:262144|15663105|0|m,a,s,p". Settings are id:value
// in wire order; the window update is "00" when absent; PRIORITY frames are
// stream:exclusive:dependency:weight (the real weight, 1..256) or "0";
// pseudo-headers are their initial letters (only :method, :authority,
// :scheme and :path have one).
func (h *H2) Akamai() string {
	var b strings.Builder
	for i, s := range h.Settings {
		if i > 0 {
			b.WriteByte(';')
		}
		fmt.Fprintf(&b, "%d:%d", s.ID, s.Val)
	}
	b.WriteByte('|')
	if h.WindowUpdate == 0 {
		b.WriteString("00")
	} else {
		b.WriteString(strconv.FormatUint(uint64(h.WindowUpdate), 10))
	}
	b.WriteByte('|')
	if len(h.Priorities) == 0 {
		b.WriteByte('0')
	}
	for i, p := range h.Priorities {
		if i > 0 {
			b.WriteByte(',')
		}
		excl := 0
		if p.Exclusive {
			excl = 1
		}
		fmt.Fprintf(&b, "%d:%d:%d:%d", p.StreamID, excl, p.StreamDep, int(p.Weight)+1)
	}
	b.WriteByte('|')
	first := true
	for _, p := range h.PseudoOrder {
		var c string
		switch p {
		case ":method":
			c = "m"
		case ":authority":
			c = "a"
		case ":scheme":
			c = "s"
		case ":path":
			c = "p"
		default:
			continue
		}
		if !first {
			b.WriteByte(',')
		}
		first = false
		b.WriteString(c)
	}
	return b.String()
}

// H2Request is one request an [H2Decoder] decoded: what identifies it to a
// server handler, and its shape.
type H2Request struct {
	StreamID  uint32
	Method    string
	Authority string // :authority, else the host header
	Path      string
	Shape     Shape
}

// HTTP/2 frame types and flags the decoder reads (RFC 9113 §6).
const (
	frameData         = 0x0
	frameHeaders      = 0x1
	framePriority     = 0x2
	frameSettings     = 0x4
	framePushPromise  = 0x5
	frameWindowUpdate = 0x8
	frameContinuation = 0x9

	flagAck        = 0x1
	flagEndHeaders = 0x4
	flagPadded     = 0x8
	flagPriority   = 0x20

	frameHeaderLen = 9
)

// Limits of the decoder. A server rejects anything beyond the first three,
// so the decoder stopping there loses nothing.
const (
	// maxBufferedFrame bounds the frames the decoder holds whole (every
	// type but DATA and unknown ones, which it skips): x/net's server reads
	// frames up to 1 MiB by default.
	maxBufferedFrame = 1 << 20
	// maxHeaderBlock bounds one header block across its CONTINUATIONs.
	maxHeaderBlock = 1 << 20
	// maxHeaderList bounds the fields kept of one decoded header list,
	// counted as SETTINGS_MAX_HEADER_LIST_SIZE counts them (RFC 9113
	// §6.5.2: name, value and 32 bytes per field): net/http's default
	// MaxHeaderBytes (the proxy's is 64 KiB). Past it the server answers
	// 431 without calling a handler, so the request needs no shape. Without
	// it, a block of 1-byte references to one table entry decoded to a
	// million fields: 300 MB allocated for 1 MiB read.
	maxHeaderList = 1 << 20
	// maxPrefacePriorities bounds the PRIORITY frames kept before the first
	// request. A server takes any number, but real clients send a handful
	// (Firefox's tree was 6), and each one kept is replayed to the origin
	// on every mirrored connection: past it the decoder gives up rather
	// than hold (and replay) whatever a client streams.
	maxPrefacePriorities = 100
)

// ErrNotH2 means the bytes do not start with the HTTP/2 client preface.
var ErrNotH2 = errors.New("fingerprint: not an HTTP/2 client preface")

// An H2Decoder follows the client-to-server bytes of an HTTP/2 connection,
// fed in order with Write, and decodes the preface and the shape of every
// request. It keeps HPACK state, so it must see every byte. It buffers at
// most one frame (DATA payloads are skipped, not held). Once Write has
// failed, the decoder is dead and keeps returning that error.
type H2Decoder struct {
	buf []byte // an incomplete frame (or preface)

	skip int // bytes of a skipped frame payload still to come

	prefaceOK bool
	err       error
	dec       *hpack.Decoder

	// The fields of the header block being decoded, what is left of its
	// maxHeaderList budget, and whether it ran out.
	fields    []hpack.HeaderField
	listLeft  uint32
	truncated bool

	// The preface under construction, and whether it is complete.
	pre      H2
	settings bool // the first non-ACK SETTINGS has been seen
	done     bool // the first request has been seen

	// The header block being gathered across CONTINUATION frames.
	block       []byte
	blockStream uint32
	blockPrio   *Priority
	blockPush   bool // a PUSH_PROMISE block (a client never sends one)

	lastStream uint32 // highest client stream opened
	reqs       []H2Request
}

// NewH2Decoder returns a decoder for a connection whose server allows a
// dynamic HPACK table of headerTableSize bytes (the server's
// SETTINGS_HEADER_TABLE_SIZE; 4096 unless it sent another).
func NewH2Decoder(headerTableSize uint32) *H2Decoder {
	d := &H2Decoder{}
	d.dec = hpack.NewDecoder(headerTableSize, d.emit)
	d.dec.SetMaxStringLength(maxHeaderBlock)
	return d
}

// emit keeps a decoded field while the header list is within
// maxHeaderList, as x/net's server does; past it the decoder still decodes
// (the HPACK table must follow every block) but keeps nothing.
func (d *H2Decoder) emit(f hpack.HeaderField) {
	if size := f.Size(); size <= d.listLeft {
		d.listLeft -= size
		d.fields = append(d.fields, f)
		return
	}
	d.dec.SetEmitEnabled(false)
	d.truncated = true
}

// Preface returns the client's preface once its first request has been
// decoded, else nil. The value is not changed afterwards.
func (d *H2Decoder) Preface() *H2 {
	if !d.done {
		return nil
	}
	return &d.pre
}

// Requests returns the requests decoded since the last call.
func (d *H2Decoder) Requests() []H2Request {
	r := d.reqs
	d.reqs = nil
	return r
}

// Err returns the error that stopped the decoder, if any.
func (d *H2Decoder) Err() error { return d.err }

// Write feeds the next bytes the client sent. It never holds on to p.
func (d *H2Decoder) Write(p []byte) (int, error) {
	if d.err != nil {
		return 0, d.err
	}
	n := len(p)
	if err := d.write(p); err != nil {
		d.err = err
		d.buf, d.block = nil, nil
		return 0, err
	}
	return n, nil
}

func (d *H2Decoder) write(p []byte) error {
	for len(p) > 0 {
		if d.skip > 0 {
			k := min(d.skip, len(p))
			d.skip -= k
			p = p[k:]
			continue
		}
		if !d.prefaceOK {
			need := len(ClientPreface) - len(d.buf)
			k := min(need, len(p))
			d.buf = append(d.buf, p[:k]...)
			p = p[k:]
			if string(d.buf) != ClientPreface[:len(d.buf)] {
				return ErrNotH2
			}
			if len(d.buf) == len(ClientPreface) {
				d.prefaceOK = true
				d.buf = d.buf[:0]
			}
			continue
		}
		if len(d.buf) < frameHeaderLen {
			k := min(frameHeaderLen-len(d.buf), len(p))
			d.buf = append(d.buf, p[:k]...)
			p = p[k:]
			if len(d.buf) < frameHeaderLen {
				return nil
			}
			length := int(d.buf[0])<<16 | int(d.buf[1])<<8 | int(d.buf[2])
			typ := d.buf[3]
			if d.block != nil && typ != frameContinuation {
				return errors.New("fingerprint: h2: header block interrupted")
			}
			if typ == frameData || typ > frameContinuation {
				// Skipped whole: only its length matters.
				d.skip = length
				d.buf = d.buf[:0]
				continue
			}
			if length > maxBufferedFrame {
				return fmt.Errorf("fingerprint: h2: frame of %d bytes", length)
			}
		}
		length := int(d.buf[0])<<16 | int(d.buf[1])<<8 | int(d.buf[2])
		k := min(frameHeaderLen+length-len(d.buf), len(p))
		d.buf = append(d.buf, p[:k]...)
		p = p[k:]
		if len(d.buf) < frameHeaderLen+length {
			return nil
		}
		hdr, payload := d.buf[:frameHeaderLen], d.buf[frameHeaderLen:]
		stream := binary.BigEndian.Uint32(hdr[5:]) & (1<<31 - 1)
		if err := d.frame(hdr[3], hdr[4], stream, payload); err != nil {
			return err
		}
		d.buf = d.buf[:0]
	}
	return nil
}

// frame handles one whole frame (every type but DATA and unknown ones).
func (d *H2Decoder) frame(typ, flags uint8, stream uint32, payload []byte) error {
	switch typ {
	case frameSettings:
		if flags&flagAck != 0 || d.settings {
			return nil
		}
		if stream != 0 || len(payload)%6 != 0 {
			return errors.New("fingerprint: h2: malformed SETTINGS")
		}
		d.settings = true
		for i := 0; i < len(payload); i += 6 {
			d.pre.Settings = append(d.pre.Settings, Setting{
				ID:  binary.BigEndian.Uint16(payload[i:]),
				Val: binary.BigEndian.Uint32(payload[i+2:]),
			})
		}
	case frameWindowUpdate:
		if len(payload) != 4 {
			return errors.New("fingerprint: h2: malformed WINDOW_UPDATE")
		}
		if stream == 0 && !d.done && d.pre.WindowUpdate == 0 {
			d.pre.WindowUpdate = binary.BigEndian.Uint32(payload) & (1<<31 - 1)
		}
	case framePriority:
		if len(payload) != 5 || stream == 0 {
			return errors.New("fingerprint: h2: malformed PRIORITY")
		}
		if !d.done {
			if len(d.pre.Priorities) == maxPrefacePriorities {
				return fmt.Errorf("fingerprint: h2: more than %d PRIORITY frames before the first request", maxPrefacePriorities)
			}
			p := readPriority(payload)
			p.StreamID = stream
			d.pre.Priorities = append(d.pre.Priorities, p)
		}
	case frameHeaders, framePushPromise:
		if stream == 0 {
			return errors.New("fingerprint: h2: HEADERS on stream 0")
		}
		frag := payload
		if flags&flagPadded != 0 {
			if len(frag) < 1 {
				return errors.New("fingerprint: h2: malformed padding")
			}
			pad := int(frag[0])
			frag = frag[1:]
			if pad > len(frag) {
				return errors.New("fingerprint: h2: padding exceeds frame")
			}
			frag = frag[:len(frag)-pad]
		}
		var prio *Priority
		if typ == framePushPromise {
			if len(frag) < 4 {
				return errors.New("fingerprint: h2: malformed PUSH_PROMISE")
			}
			frag = frag[4:]
		} else if flags&flagPriority != 0 {
			if len(frag) < 5 {
				return errors.New("fingerprint: h2: malformed HEADERS priority")
			}
			p := readPriority(frag)
			prio = &p
			frag = frag[5:]
		}
		d.block = append(make([]byte, 0, len(frag)), frag...)
		d.blockStream, d.blockPrio, d.blockPush = stream, prio, typ == framePushPromise
		if flags&flagEndHeaders != 0 {
			return d.endBlock()
		}
	case frameContinuation:
		if d.block == nil || stream != d.blockStream {
			return errors.New("fingerprint: h2: unexpected CONTINUATION")
		}
		if len(d.block)+len(payload) > maxHeaderBlock {
			return errors.New("fingerprint: h2: header block too large")
		}
		d.block = append(d.block, payload...)
		if flags&flagEndHeaders != 0 {
			return d.endBlock()
		}
	}
	return nil
}

func readPriority(b []byte) Priority {
	v := binary.BigEndian.Uint32(b)
	return Priority{Exclusive: v>>31 == 1, StreamDep: v & (1<<31 - 1), Weight: b[4]}
}

// endBlock decodes a complete header block. Every block is decoded, trailers
// included, to keep the HPACK table in step with the client's.
func (d *H2Decoder) endBlock() error {
	block, stream, prio, push := d.block, d.blockStream, d.blockPrio, d.blockPush
	d.block = nil
	d.fields, d.listLeft, d.truncated = nil, maxHeaderList, false
	d.dec.SetEmitEnabled(true)
	_, err := d.dec.Write(block)
	if err == nil {
		err = d.dec.Close()
	}
	fields, truncated := d.fields, d.truncated
	d.fields = nil
	if err != nil {
		return fmt.Errorf("fingerprint: h2: %w", err)
	}
	if push || stream <= d.lastStream || stream%2 == 0 {
		return nil // trailers (or nonsense the server will refuse)
	}
	d.lastStream = stream
	r := H2Request{StreamID: stream, Shape: Shape{Priority: prio}}
	for _, f := range fields {
		if strings.HasPrefix(f.Name, ":") {
			r.Shape.PseudoOrder = append(r.Shape.PseudoOrder, f.Name)
			switch f.Name {
			case ":method":
				r.Method = f.Value
			case ":authority":
				r.Authority = f.Value
			case ":path":
				r.Path = f.Value
			}
			continue
		}
		if f.Name == "host" && r.Authority == "" {
			r.Authority = f.Value
		}
		r.Shape.HeaderOrder = append(r.Shape.HeaderOrder, f.Name)
	}
	if !d.done {
		d.done = true
		d.pre.PseudoOrder = r.Shape.PseudoOrder
		d.pre.HeaderPriority = prio
		d.pre.FirstStreamID = stream
	}
	if truncated {
		// Still the client's request (and maybe its first, as above), but
		// the server answers it 431 by itself: no handler asks for its shape.
		return nil
	}
	d.reqs = append(d.reqs, r)
	return nil
}

// ParseH2Preface decodes the preface of a client's HTTP/2 connection from
// its first bytes (the 24-byte preface and the frames up to and including
// the first request's header block), assuming the default 4096-byte HPACK
// table. It also returns the first request.
func ParseH2Preface(b []byte) (*H2, *H2Request, error) {
	d := NewH2Decoder(4096)
	if _, err := d.Write(b); err != nil {
		return nil, nil, err
	}
	pre := d.Preface()
	if pre == nil {
		return nil, nil, errors.New("fingerprint: h2: no request in the bytes")
	}
	reqs := d.Requests()
	return pre, &reqs[0], nil
}
